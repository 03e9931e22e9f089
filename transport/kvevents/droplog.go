package kvevents

import (
	"fmt"
	"log/slog"
	"slices"
	"time"
)

// maxDropWorkers bounds the worker names one drop summary lists.
const maxDropWorkers = 8

// dropLog sums the messages a subscriber drops between its log lines: the first drop after a
// quiet interval is logged at once, later ones are counted and logged as one line per interval
// with a count per cause, the workers they came from and the first error, so a flood of bad
// messages of several causes neither floods the log nor hides all but one cause. Not safe for
// concurrent use (the subscriber holds turn).
type dropLog struct {
	every   time.Duration
	last    time.Time      // when the last line was logged
	counts  map[string]int // by cause, since the last line
	workers []string       // the first maxDropWorkers workers since the last line
	more    int            // workers past those
	example string         // the first error since the last line
}

func newDropLog(every time.Duration) *dropLog {
	return &dropLog{every: every, counts: make(map[string]int)}
}

// add counts one dropped message of worker, for cause.
func (l *dropLog) add(worker, cause string, err error) {
	if len(l.counts) == 0 {
		l.example = fmt.Sprintf("%s: %.256v", worker, err)
	}
	l.counts[cause]++
	switch {
	case slices.Contains(l.workers, worker):
	case len(l.workers) < maxDropWorkers:
		l.workers = append(l.workers, worker)
	default:
		l.more++
	}
}

// flush logs the counts as one line, unless there are none or a line was logged less than an
// interval before now.
func (l *dropLog) flush(log *slog.Logger, now time.Time) {
	if len(l.counts) == 0 || (!l.last.IsZero() && now.Sub(l.last) < l.every) {
		return
	}
	causes := make([]string, 0, len(l.counts))
	for c := range l.counts {
		causes = append(causes, c)
	}
	slices.Sort(causes)
	args := make([]any, 0, 2*len(causes)+8)
	total := 0
	for _, c := range causes {
		args = append(args, c, l.counts[c])
		total += l.counts[c]
	}
	args = append(args, "total", total, "workers", l.workers)
	if l.more > 0 {
		args = append(args, "more_workers", l.more)
	}
	if !l.last.IsZero() {
		args = append(args, "since", now.Sub(l.last).Round(time.Second))
	}
	args = append(args, "first_error", l.example)
	log.Warn("kv events: messages dropped", args...)
	l.last = now
	clear(l.counts)
	l.workers, l.more, l.example = l.workers[:0], 0, ""
}
