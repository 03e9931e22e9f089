package enginemetrics

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Limits on one scrape's body and what of it is parsed.
const (
	// DefaultMaxBodyBytes bounds a metrics body: vLLM's is some tens of kilobytes (its
	// histograms are most of it), more with many LoRA adapters.
	DefaultMaxBodyBytes = 4 << 20
	// maxLineBytes bounds one line that is kept; longer lines are skipped whole.
	maxLineBytes = 16 << 10
	// maxKeptLines bounds the lines of the series below that go to the parser: a few per
	// data-parallel rank is what an engine sends.
	maxKeptLines = 8 << 10
)

// Errors of a scrape that a caller tells apart (and counts by).
var (
	// ErrTooLarge: the body is over its byte limit, or has more engine series than any
	// engine sends.
	ErrTooLarge = errors.New("metrics body too large")
	// ErrParse: the engine series do not parse as the Prometheus text format.
	ErrParse = errors.New("metrics body does not parse")
)

// The series read, by engine. The model-server protocol of the Gateway API Inference
// Extension names them TotalRunningRequests, TotalQueuedRequests, KVCacheUtilization and
// the cache info (block size and blocks as labels).
const (
	vllmRunning     = "vllm:num_requests_running"
	vllmWaiting     = "vllm:num_requests_waiting"
	vllmKVUsage     = "vllm:kv_cache_usage_perc"
	vllmGPUKVUsage  = "vllm:gpu_cache_usage_perc" // its name in older vLLM
	vllmCacheConfig = "vllm:cache_config_info"
	sglangRunning   = "sglang:num_running_reqs"
	sglangWaiting   = "sglang:num_queue_reqs"
	sglangKVUsage   = "sglang:token_usage"
	sglangMaxTokens = "sglang:max_total_num_tokens"
)

// wanted reports whether a family is kept from a body: everything else is skipped before
// parsing.
func wanted(name string) bool {
	switch name {
	case vllmRunning, vllmWaiting, vllmKVUsage, vllmGPUKVUsage, vllmCacheConfig,
		sglangRunning, sglangWaiting, sglangKVUsage, sglangMaxTokens:
		return true
	}
	return false
}

// Parse reads a Prometheus text-format metrics body of at most maxBytes (0:
// DefaultMaxBodyBytes) and returns the engine load it reports. The lines of the series it
// reads are picked out first and only they go to the text parser (expfmt), so a large body
// costs a scan, not a parse; a body over the limit is ErrTooLarge, one that does not parse
// ErrParse. A body without any of the series is an empty report, not an error.
//
// Series are taken per data-parallel rank (the engine or dp_rank label; a series without
// one is the whole worker's); several series of one rank (SGLang's per tensor-parallel rank
// copies) count as copies of one figure, the largest. Values that are not finite and
// non-negative are ignored.
func Parse(r io.Reader, maxBytes int64) (routing.EngineReport, error) {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxBodyBytes
	}
	kept, err := keepWanted(io.LimitReader(r, maxBytes+1), maxBytes)
	if err != nil {
		return routing.EngineReport{}, err
	}
	if len(kept) == 0 {
		return routing.EngineReport{}, nil
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	families, err := p.TextToMetricFamilies(bytes.NewReader(kept))
	if err != nil {
		return routing.EngineReport{}, fmt.Errorf("%w: %w", ErrParse, err)
	}
	return report(families), nil
}

// keepWanted copies the lines of the wanted families (their samples and their HELP and
// TYPE comments) out of r, which holds at most max+1 bytes.
func keepWanted(r io.Reader, max int64) ([]byte, error) {
	br := bufio.NewReaderSize(r, maxLineBytes)
	var out []byte
	var read int64
	lines := 0
	for {
		line, err := br.ReadSlice('\n')
		read += int64(len(line))
		long := errors.Is(err, bufio.ErrBufferFull)
		for errors.Is(err, bufio.ErrBufferFull) {
			// The rest of an over-long line is skipped, never kept.
			var more []byte
			more, err = br.ReadSlice('\n')
			read += int64(len(more))
		}
		if read > max {
			return nil, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, max)
		}
		if !long && len(line) > 0 && wanted(familyOf(line)) {
			if lines++; lines > maxKeptLines {
				return nil, fmt.Errorf("%w: more than %d lines of engine load series", ErrTooLarge, maxKeptLines)
			}
			out = append(out, line...)
			if line[len(line)-1] != '\n' {
				out = append(out, '\n')
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return out, nil
			}
			return nil, fmt.Errorf("read metrics: %w", err)
		}
	}
}

// familyOf is the metric family a text-format line belongs to: a sample's name, or the
// name a HELP or TYPE comment is about; "" for other comments and blank lines.
func familyOf(line []byte) string {
	line = bytes.TrimLeft(line, " \t")
	if len(line) > 0 && line[0] == '#' {
		f := bytes.Fields(line[1:])
		if len(f) < 2 || (string(f[0]) != "HELP" && string(f[0]) != "TYPE") {
			return ""
		}
		return string(f[1])
	}
	end := bytes.IndexAny(line, "{ \t\r\n")
	if end < 0 {
		end = len(line)
	}
	return string(line[:end])
}

// figures are one rank's values as read; NaN is not reported.
type figures struct {
	running, waiting, usage, gpuUsage, tokenUsage float64
	blocks, blockSize, maxTokens                  float64
}

func newFigures() *figures {
	n := math.NaN()
	return &figures{n, n, n, n, n, n, n, n}
}

// set keeps the largest of the copies of a figure.
func set(dst *float64, v float64) {
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
		return
	}
	if math.IsNaN(*dst) || v > *dst {
		*dst = v
	}
}

// report turns the parsed families into per-rank samples.
func report(families map[string]*dto.MetricFamily) routing.EngineReport {
	byRank := map[int]*figures{}
	get := func(m *dto.Metric) *figures {
		rank := rankOf(m)
		f := byRank[rank]
		if f == nil {
			f = newFigures()
			byRank[rank] = f
		}
		return f
	}
	for name, mf := range families {
		for _, m := range mf.GetMetric() {
			v := value(m)
			switch name {
			case vllmRunning, sglangRunning:
				set(&get(m).running, v)
			case vllmWaiting, sglangWaiting:
				set(&get(m).waiting, v)
			case vllmKVUsage:
				set(&get(m).usage, v)
			case vllmGPUKVUsage:
				set(&get(m).gpuUsage, v)
			case sglangKVUsage:
				set(&get(m).tokenUsage, v)
			case sglangMaxTokens:
				set(&get(m).maxTokens, v)
			case vllmCacheConfig:
				f := get(m)
				set(&f.blocks, labelNumber(m, "num_gpu_blocks"))
				set(&f.blockSize, labelNumber(m, "block_size"))
			}
		}
	}
	var rep routing.EngineReport
	whole := byRank[-1]
	for rank, f := range byRank {
		if rank < 0 {
			continue
		}
		if whole != nil {
			f.inherit(whole) // e.g. a cache_config_info without the engine label
		}
		if s, ok := f.sample(); ok {
			if rep.Ranks == nil {
				rep.Ranks = map[int]routing.EngineSample{}
			}
			rep.Ranks[rank] = s
		}
	}
	if len(rep.Ranks) == 0 && whole != nil {
		if s, ok := whole.sample(); ok {
			rep.Whole = &s
		}
	}
	return rep
}

// inherit fills the cache figures f lacks from the worker-wide ones.
func (f *figures) inherit(w *figures) {
	for _, p := range []struct{ dst, src *float64 }{{&f.blocks, &w.blocks}, {&f.blockSize, &w.blockSize}, {&f.maxTokens, &w.maxTokens}} {
		if math.IsNaN(*p.dst) {
			*p.dst = *p.src
		}
	}
}

// sample is the rank's EngineSample; false when it reports no request count.
func (f *figures) sample() (routing.EngineSample, bool) {
	if math.IsNaN(f.running) && math.IsNaN(f.waiting) {
		return routing.EngineSample{}, false
	}
	s := routing.EngineSample{Running: zeroNaN(f.running), Waiting: zeroNaN(f.waiting), KVUsage: -1}
	for _, u := range []float64{f.usage, f.gpuUsage, f.tokenUsage} {
		if !math.IsNaN(u) {
			s.KVUsage = min(u, 1)
			break
		}
	}
	switch {
	case !math.IsNaN(f.blocks) && f.blocks > 0:
		s.KVBlocks = f.blocks
		if !math.IsNaN(f.blockSize) && f.blockSize >= 1 && f.blockSize <= 1<<16 {
			s.KVBlockSize = int(f.blockSize)
		}
	case !math.IsNaN(f.maxTokens) && f.maxTokens > 0:
		// SGLang sizes its cache in tokens.
		s.KVBlocks, s.KVBlockSize = f.maxTokens, 1
	}
	return s, true
}

func zeroNaN(v float64) float64 {
	if math.IsNaN(v) {
		return 0
	}
	return v
}

// rankOf is a series' data-parallel rank, -1 for none (the whole worker): the engine label
// (vLLM's engine index) or else dp_rank (SGLang's).
func rankOf(m *dto.Metric) int {
	for _, name := range [...]string{"engine", "dp_rank"} {
		for _, lp := range m.GetLabel() {
			if lp.GetName() != name {
				continue
			}
			n, err := strconv.Atoi(lp.GetValue())
			if err != nil || n < 0 || n >= routing.MaxDPSize {
				return -1
			}
			return n
		}
	}
	return -1
}

// value is a gauge's (or an untyped or counter series') value; NaN for other types.
func value(m *dto.Metric) float64 {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	}
	return math.NaN()
}

// labelNumber is a label's value as a number; NaN when absent or not a number (vLLM
// writes None before the cache is sized).
func labelNumber(m *dto.Metric, name string) float64 {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			v, err := strconv.ParseFloat(lp.GetValue(), 64)
			if err != nil {
				return math.NaN()
			}
			return v
		}
	}
	return math.NaN()
}
