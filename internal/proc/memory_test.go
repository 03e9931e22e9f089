package proc

import "testing"

func TestReadMemoryOfThisProcess(t *testing.T) {
	m, err := ReadMemory("self")
	if err != nil {
		t.Fatal(err)
	}
	if m.RSS == 0 || m.PeakRSS < m.RSS {
		t.Fatalf("RSS %d, peak %d", m.RSS, m.PeakRSS)
	}
	if _, err := ReadMemory("0"); err == nil {
		t.Fatal("no error for a process that does not exist")
	}
}
