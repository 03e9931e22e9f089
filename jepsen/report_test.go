package jepsen

import (
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestReportOfAFailingHistoryNamesTheOperationsAndDrawsTheSession(t *testing.T) {
	b := (&hist{}).saw("a", 0, 10, "w0", 5).fault(FaultWorkerCrash, "w0", 15, 60).
		saw("a", 20, 30, "w1", 9).saw("a", 500, 510, "w0", 5).saw("b", 0, 10, "w2", 6)
	rep := Recheck(&b.h, testCheck)
	if rep.Valid() {
		t.Fatal("a history with a revision going backwards passed")
	}
	var text bytes.Buffer
	if err := rep.WriteText(&text); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"FAIL: 2 violations", "[revision-backwards]", "[register]", "op 3: client 0 session a via r0", "saw w0@5 from r0", "worker-crash"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, text.String())
		}
	}
	dir := t.TempDir()
	if err := rep.write(dir, &b.h, testCheck); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(rep.Files, "porcupine-a.html") || slices.Contains(rep.Files, "porcupine-b.html") {
		t.Fatalf("files %v: want a page for the failing session a only", rep.Files)
	}
	page, err := os.ReadFile(filepath.Join(dir, "porcupine-a.html"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(page, []byte("w1@9")) || !bytes.Contains(page, []byte("nemesis")) {
		t.Fatal("the page does not show the session's operations and the faults")
	}
	for _, f := range []string{"summary.txt", "report.json", "history.json"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	h, err := ReadHistoryFile(filepath.Join(dir, "history.json"))
	if err != nil || len(h.Ops) != len(b.h.Ops) {
		t.Fatalf("saved history: %v, %d ops", err, len(h.Ops))
	}
}

func TestReportOfAPassingHistorySaysSo(t *testing.T) {
	b := (&hist{}).saw("a", 0, 10, "w0", 5).saw("a", 20, 30, "w0", 5)
	rep := Recheck(&b.h, testCheck)
	var text bytes.Buffer
	if err := rep.WriteText(&text); err != nil {
		t.Fatal(err)
	}
	if !rep.Valid() || !strings.HasPrefix(text.String(), "kvrouter-ha jepsen: PASS: 0 violations") || strings.Contains(text.String(), "violations:\n") {
		t.Fatalf("summary:\n%s", text.String())
	}
}
