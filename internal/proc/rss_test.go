package proc

import "testing"

func TestReadRSSOfThisProcess(t *testing.T) {
	rss, err := ReadRSS("self")
	if err != nil || rss < 1<<20 {
		t.Fatalf("RSS %d, %v; want at least a MiB", rss, err)
	}
	if _, err := ReadRSS("0"); err == nil {
		t.Fatal("pid 0 has an RSS")
	}
}
