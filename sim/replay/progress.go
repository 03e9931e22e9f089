package replay

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"
)

// progress reports a run's requests as they finish: a redrawn bar on a terminal, and one
// plain line every few seconds anywhere else (a CI log, `make demo > log`), where a bar's
// carriage-return frames would pile up as hundreds of lines.
type progress interface {
	add()
	// finish ends the report; done says the run was not interrupted.
	finish(done bool)
}

// logLineEvery spaces the plain progress lines.
const logLineEvery = 5 * time.Second

// newProgress is the report for n requests on cfg.Progress, nil for none.
func newProgress(cfg Config, n int) progress {
	if cfg.Progress == nil || n == 0 {
		return nil
	}
	label := cfg.Label
	if label == "" {
		label = "replay"
	}
	if isTerminal(cfg.Progress) {
		return &barProgress{bar: progressbar.NewOptions(n,
			progressbar.OptionSetWriter(cfg.Progress),
			progressbar.OptionSetDescription(label),
			progressbar.OptionShowCount(),
			progressbar.OptionShowIts(),
			progressbar.OptionSetItsString("req"),
			progressbar.OptionThrottle(200*time.Millisecond),
		), w: cfg.Progress}
	}
	every := cfg.ProgressEvery
	if every <= 0 {
		every = logLineEvery
	}
	now := time.Now()
	return &lineProgress{w: cfg.Progress, label: label, total: n, every: every, start: now, last: now}
}

// isTerminal reports whether w is a character device (a terminal), not a file or a pipe.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

type barProgress struct {
	bar *progressbar.ProgressBar
	w   io.Writer
}

func (b *barProgress) add() { _ = b.bar.Add(1) }

func (b *barProgress) finish(done bool) {
	if done {
		_ = b.bar.Finish()
	}
	fmt.Fprintln(b.w)
}

// lineProgress writes "label: 120/1000 requests (12%), 48.0 req/s" at most every interval,
// and a last line at the end.
type lineProgress struct {
	mu    sync.Mutex
	w     io.Writer
	label string
	total int
	every time.Duration
	start time.Time
	last  time.Time
	n     int
}

func (l *lineProgress) add() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n++
	if now := time.Now(); now.Sub(l.last) >= l.every {
		l.last = now
		l.line(now, "")
	}
}

func (l *lineProgress) finish(done bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	tail := ", done"
	if !done {
		tail = ", interrupted"
	}
	l.line(time.Now(), tail)
}

func (l *lineProgress) line(now time.Time, tail string) {
	rate := 0.0
	if s := now.Sub(l.start).Seconds(); s > 0 {
		rate = float64(l.n) / s
	}
	fmt.Fprintf(l.w, "%s: %d/%d requests (%d%%), %.1f req/s%s\n", l.label, l.n, l.total, l.n*100/l.total, rate, tail)
}
