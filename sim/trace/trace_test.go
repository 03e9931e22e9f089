package trace_test

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/sim/trace"
)

// realTrace is the bundled Mooncake trace, the file trace.Bundled embeds (in the repository:
// a test never reads outside it).
const realTrace = "data/mooncake_synthetic_trace.jsonl"

func TestReadParsesGoodLines(t *testing.T) {
	in := `{"timestamp": 0, "input_length": 1000, "output_length": 6, "hash_ids": [0, 1]}

{"timestamp": 40.5, "input_length": 512, "output_length": 0, "hash_ids": [0], "extra": "ignored"}
  {"timestamp": 277, "input_length": 1, "output_length": 92, "hash_ids": [18446744073709551615]}  
`
	got, err := trace.Read(strings.NewReader(in))
	if err != nil {
		t.Fatalf("Read: %v", err)
	}
	want := []trace.Request{
		{Index: 0, Timestamp: 0, InputLength: 1000, OutputLength: 6, HashIDs: []uint64{0, 1}},
		{Index: 1, Timestamp: 40500 * time.Microsecond, InputLength: 512, OutputLength: 0, HashIDs: []uint64{0}},
		{Index: 2, Timestamp: 277 * time.Millisecond, InputLength: 1, OutputLength: 92, HashIDs: []uint64{1<<64 - 1}},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d requests, want %d", len(got), len(want))
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.Index != w.Index || g.Timestamp != w.Timestamp || g.InputLength != w.InputLength ||
			g.OutputLength != w.OutputLength || !slices.Equal(g.HashIDs, w.HashIDs) || g.Session != "" {
			t.Errorf("request %d = %+v, want %+v", i, g, w)
		}
	}
}

func TestReadRejectsBadLinesWithLineNumber(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}` + "\n"
	tests := []struct {
		name    string
		line    string
		wantErr string
	}{
		{"not JSON", `{"timestamp": 0,`, "bad JSON"},
		{"trailing garbage", `{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]} x`, "bad JSON"},
		{"array", `[1, 2]`, "bad JSON"},
		{"missing timestamp", `{"input_length": 10, "output_length": 1, "hash_ids": [7]}`, "missing timestamp"},
		{"missing input", `{"timestamp": 0, "output_length": 1, "hash_ids": [7]}`, "missing input_length"},
		{"missing output", `{"timestamp": 0, "input_length": 10, "hash_ids": [7]}`, "missing output_length"},
		{"negative timestamp", `{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [7]}`, "timestamp"},
		{"huge timestamp", `{"timestamp": 1e300, "input_length": 10, "output_length": 1, "hash_ids": [7]}`, "timestamp"},
		{"zero input", `{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}`, "input_length 0"},
		{"absurd input", `{"timestamp": 0, "input_length": 2000001, "output_length": 1, "hash_ids": [7]}`, "input_length 2000001"},
		{"negative output", `{"timestamp": 0, "input_length": 10, "output_length": -3, "hash_ids": [7]}`, "output_length -3"},
		{"too few ids", `{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [7]}`, "want ceil(513/512) = 2"},
		{"too many ids", `{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7, 8]}`, "2 hash_ids"},
		{"negative id", `{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-7]}`, "bad JSON"},
		{"fractional input", `{"timestamp": 0, "input_length": 1.5, "output_length": 1, "hash_ids": [7]}`, "bad JSON"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Two good lines and a blank one first: the error must name line 4.
			in := good + "\n" + good + tt.line + "\n" + good
			reqs, err := trace.Read(strings.NewReader(in))
			if err == nil {
				t.Fatalf("Read accepted %q", tt.line)
			}
			if reqs != nil {
				t.Errorf("Read returned %d requests with an error", len(reqs))
			}
			if !strings.Contains(err.Error(), "line 4:") || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("error %q, want line 4 and %q", err, tt.wantErr)
			}
		})
	}
}

func TestReadRejectsOverlongLine(t *testing.T) {
	in := `{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}` + "\n" +
		`{"pad": "` + strings.Repeat("x", 2<<20) + `"}` + "\n"
	_, err := trace.Read(strings.NewReader(in))
	if err == nil || !strings.Contains(err.Error(), "line 2:") {
		t.Fatalf("error %v, want one naming line 2", err)
	}
}

func TestReadAcceptsMaximalPrompt(t *testing.T) {
	n := trace.BlockCount(trace.MaxInputLength)
	ids := make([]string, n)
	for i := range ids {
		ids[i] = "18446744073709551615"
	}
	in := fmt.Sprintf(`{"timestamp": 0, "input_length": %d, "output_length": 1, "hash_ids": [%s]}`,
		trace.MaxInputLength, strings.Join(ids, ", "))
	reqs, err := trace.Read(strings.NewReader(in))
	if err != nil {
		t.Fatalf("Read: %v", err)
	}
	if len(reqs[0].HashIDs) != n {
		t.Errorf("got %d ids, want %d", len(reqs[0].HashIDs), n)
	}
}

func TestLoadNamesPathOnError(t *testing.T) {
	if _, err := trace.Load("/nonexistent/trace.jsonl"); err == nil {
		t.Fatal("Load of a missing file succeeded")
	}
	p := t.TempDir() + "/bad.jsonl"
	if err := os.WriteFile(p, []byte("nope\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := trace.Load(p)
	if err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "line 1") {
		t.Fatalf("error %v, want path and line 1", err)
	}
}

func TestTokensIsDeterministicAndInRange(t *testing.T) {
	req := trace.Request{InputLength: 1300, HashIDs: []uint64{5, 9, 11}}
	a := trace.Tokens(req, 512, nil)
	b := trace.Tokens(req, 512, make([]uint32, 3, 10))
	if len(a) != 1300 {
		t.Fatalf("got %d tokens, want InputLength 1300", len(a))
	}
	if !slices.Equal(a, b) {
		t.Fatal("two calls gave different tokens")
	}
	distinct := make(map[uint32]bool)
	for i, tok := range a {
		if tok < 1000 || tok >= 151000 {
			t.Fatalf("token %d = %d outside [1000, 151000)", i, tok)
		}
		distinct[tok] = true
	}
	// A degenerate mix (constant, or depending on j only) would give few values.
	if len(distinct) < 1200 {
		t.Errorf("only %d distinct tokens in 1300", len(distinct))
	}
}

func TestTokensKeepsPrefixStructure(t *testing.T) {
	first := trace.Request{InputLength: 1100, HashIDs: []uint64{1, 2, 3}}
	// Shares blocks 1 and 2 only, then diverges.
	second := trace.Request{InputLength: 1536, HashIDs: []uint64{1, 2, 4}}
	// Same first id at a different position and a different id first.
	other := trace.Request{InputLength: 1024, HashIDs: []uint64{2, 1}}

	a := trace.Tokens(first, 0, nil)
	b := trace.Tokens(second, 0, nil)
	c := trace.Tokens(other, 0, nil)
	if !slices.Equal(a[:1024], b[:1024]) {
		t.Error("shared blocks gave different tokens")
	}
	if slices.Equal(a[1024:1100], b[1024:1100]) {
		t.Error("different third blocks gave the same tokens")
	}
	if !slices.Equal(c[:512], a[512:1024]) {
		t.Error("block id 2 gave different tokens at a different position")
	}
	if slices.Equal(c[:16], a[:16]) {
		t.Error("different first blocks share their first 16 tokens")
	}
	// A request's own prompt is a prefix of the same chain extended.
	longer := trace.Tokens(trace.Request{InputLength: 1536, HashIDs: []uint64{1, 2, 3}}, 0, nil)
	if !slices.Equal(longer[:1100], a) {
		t.Error("truncated last block is not a prefix of the full block")
	}
}

func TestTokensHandlesOddInput(t *testing.T) {
	tests := []struct {
		name        string
		req         trace.Request
		blockTokens int
		want        int
	}{
		{"no ids", trace.Request{InputLength: 100}, 512, 0},
		{"fewer ids than length", trace.Request{InputLength: 2000, HashIDs: []uint64{1}}, 512, 512},
		{"small block size", trace.Request{InputLength: 40, HashIDs: []uint64{1, 2, 3}}, 16, 40},
		{"negative length", trace.Request{InputLength: -5, HashIDs: []uint64{1}}, 512, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := len(trace.Tokens(tt.req, tt.blockTokens, nil)); got != tt.want {
				t.Errorf("got %d tokens, want %d", got, tt.want)
			}
		})
	}
}

// mk builds a request with the given ids; full says whether its last block
// is a whole 512 tokens.
func mk(full bool, ids ...uint64) trace.Request {
	n := len(ids) * trace.BlockTokens
	if !full {
		n -= 100
	}
	return trace.Request{InputLength: n, HashIDs: ids}
}

func TestAssignSessions(t *testing.T) {
	tests := []struct {
		name string
		reqs []trace.Request
		want []string
	}{
		{
			name: "unrelated requests start their own sessions",
			reqs: []trace.Request{mk(true, 1, 2), mk(true, 3, 4), mk(false, 5)},
			want: []string{"s0", "s1", "s2"},
		},
		{
			name: "a turn extending a full-block prompt continues it",
			reqs: []trace.Request{mk(true, 1, 2), mk(false, 1, 2, 3), mk(false, 1, 2, 3, 4)},
			// The second ends in a partial block (id 3): the third continues it
			// through ids 1, 2.
			want: []string{"s0", "s0", "s0"},
		},
		{
			name: "a partial last block is dropped before matching",
			reqs: []trace.Request{mk(false, 1, 2, 3), mk(false, 1, 2, 9, 10)},
			want: []string{"s0", "s0"},
		},
		{
			name: "a full last block must match",
			reqs: []trace.Request{mk(true, 1, 2, 3), mk(false, 1, 2, 9, 10)},
			want: []string{"s0", "s1"},
		},
		{
			name: "sharing only part of an earlier chain is a new session",
			reqs: []trace.Request{mk(true, 1, 2, 3), mk(true, 1, 2)},
			want: []string{"s0", "s1"},
		},
		{
			name: "the longest earlier chain wins",
			reqs: []trace.Request{mk(true, 1), mk(true, 7, 8), mk(true, 1, 2), mk(true, 1, 2, 3)},
			want: []string{"s0", "s1", "s0", "s0"},
		},
		{
			name: "the longest chain wins over a more recent shorter one",
			reqs: []trace.Request{mk(true, 1, 2), mk(true, 1), mk(true, 1, 2, 3)},
			// Request 1 only shares id 1 with request 0's chain (1, 2): new session.
			want: []string{"s0", "s1", "s0"},
		},
		{
			name: "a chain the trace continues two ways is a shared prefix",
			// Chain (1, 2), where requests 1 and 2 end, goes on with 3 (requests 0 and 2)
			// and with 7 (request 3): a shared opening, which continues nobody's session.
			reqs: []trace.Request{mk(true, 1, 2, 3), mk(true, 1, 2), mk(false, 1, 2, 3), mk(true, 1, 2, 7)},
			want: []string{"s0", "s1", "s0", "s3"},
		},
		{
			name: "a short first turn that is only the system prompt anchors nothing",
			// Requests 0 and 3 are a conversation's turns whose whole blocks are the
			// two-block system prompt (10, 11); 1, 2 and 4 are conversations that open
			// with it. Each conversation's later turn continues its own first turn.
			reqs: []trace.Request{
				mk(false, 10, 11, 12), // A, turn 1: the system prompt and a partial block
				mk(true, 10, 11, 20, 21),
				mk(true, 10, 11, 30),
				mk(true, 10, 11, 20, 21, 22), // the second conversation's next turn
				mk(true, 10, 11, 40, 41),
				mk(true, 10, 11, 30, 31), // the third conversation's next turn
			},
			want: []string{"s0", "s1", "s2", "s1", "s4", "s2"},
		},
		{
			name: "ties go to the most recent",
			// Requests 0 and 1 both end at chain (5, 6) (1 repeats 0 with a partial
			// block more); request 2 continues the more recent.
			reqs: []trace.Request{mk(true, 5, 6), mk(false, 5, 6, 7), mk(true, 5, 6, 7)},
			want: []string{"s0", "s0", "s0"},
		},
		{
			name: "single partial block never anchors a session",
			reqs: []trace.Request{mk(false, 1), mk(false, 2), mk(true, 1, 2)},
			want: []string{"s0", "s1", "s2"},
		},
		{
			name: "an identical repeat continues",
			reqs: []trace.Request{mk(false, 1, 2), mk(false, 1, 2)},
			want: []string{"s0", "s0"},
		},
		{
			name: "empty trace",
			reqs: nil,
			want: nil,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for i := range tt.reqs {
				tt.reqs[i].Index = i
			}
			trace.AssignSessions(tt.reqs)
			var got []string
			for _, r := range tt.reqs {
				got = append(got, r.Session)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("sessions %v, want %v", got, tt.want)
			}
		})
	}
}

func TestCeilingOnHandMadeTrace(t *testing.T) {
	reqs := []trace.Request{
		{InputLength: 1024, HashIDs: []uint64{1, 2}},       // 0 hit of 2 blocks, 0 of 1024 tokens
		{InputLength: 1200, HashIDs: []uint64{1, 2, 3}},    // 2 hit of 3; 1024 of 1200
		{InputLength: 1100, HashIDs: []uint64{1, 2, 3}},    // 3 of 3; 1100 of 1100 (partial block counts 76)
		{InputLength: 1536, HashIDs: []uint64{9, 2, 3}},    // 0 of 3: the run stops at the first miss
		{InputLength: 600, HashIDs: []uint64{1, 8}},        // 1 of 2; 512 of 600
		{InputLength: 512, HashIDs: []uint64{4}},           // 0 of 1
		{InputLength: 100, HashIDs: []uint64{4}},           // 1 of 1; 100 of 100
		{InputLength: 1000, HashIDs: []uint64{1, 2}},       // 2 of 2; 1000 of 1000
		{InputLength: 2048, HashIDs: []uint64{1, 2, 3, 5}}, // 3 of 4; 1536 of 2048
	}
	blocks := 2.0 + 3 + 3 + 3 + 2 + 1 + 1 + 2 + 4
	hitBlocks := 0.0 + 2 + 3 + 0 + 1 + 0 + 1 + 2 + 3
	tokens := 1024.0 + 1200 + 1100 + 1536 + 600 + 512 + 100 + 1000 + 2048
	hitTokens := 0.0 + 1024 + 1100 + 0 + 512 + 0 + 100 + 1000 + 1536
	b, tok := trace.Ceiling(reqs)
	if b != hitBlocks/blocks || tok != hitTokens/tokens {
		t.Errorf("Ceiling = %v, %v; want %v, %v", b, tok, hitBlocks/blocks, hitTokens/tokens)
	}
	if b, tok := trace.Ceiling(nil); b != 0 || tok != 0 {
		t.Errorf("Ceiling(nil) = %v, %v; want 0, 0", b, tok)
	}
}

// loadReal is the bundled Mooncake trace.
func loadReal(tb testing.TB) []trace.Request {
	tb.Helper()
	reqs, err := trace.Bundled()
	if err != nil {
		tb.Fatalf("Bundled: %v", err)
	}
	return reqs
}

func TestCeilingReproducesPublishedFiguresOnRealTrace(t *testing.T) {
	reqs := loadReal(t)
	if len(reqs) != 3993 {
		t.Fatalf("got %d requests, want 3993", len(reqs))
	}
	b, tok := trace.Ceiling(reqs)
	if b < 0.6395 || b >= 0.6405 {
		t.Errorf("block ratio %.4f, README says 64.0%%", b)
	}
	if tok < 0.6505 || tok >= 0.6515 {
		t.Errorf("token ratio %.4f, README says 65.1%%", tok)
	}
}

func TestAssignSessionsOnRealTraceGroupsTurns(t *testing.T) {
	reqs := loadReal(t)
	trace.AssignSessions(reqs)
	bySession := make(map[string][]int)
	for i, r := range reqs {
		bySession[r.Session] = append(bySession[r.Session], i)
	}
	multi := 0
	for s, idx := range bySession {
		if len(idx) > 1 {
			multi++
		}
		// A session is named after its first request.
		if want := fmt.Sprintf("s%d", reqs[idx[0]].Index); s != want {
			t.Fatalf("session %q starts at request %d", s, idx[0])
		}
	}
	if multi == 0 || len(bySession) == len(reqs) {
		t.Errorf("%d sessions, %d multi-turn: expected the trace's conversations to group", len(bySession), multi)
	}
}

func BenchmarkTokens(b *testing.B) {
	req := trace.Request{InputLength: 15325, HashIDs: make([]uint64, trace.BlockCount(15325))}
	for i := range req.HashIDs {
		req.HashIDs[i] = uint64(i)
	}
	var dst []uint32
	b.ReportAllocs()
	for b.Loop() {
		dst = trace.Tokens(req, 512, dst)
	}
	b.ReportMetric(float64(b.N)*float64(req.InputLength)/b.Elapsed().Seconds()/1e6, "Mtokens/s")
}

func BenchmarkAssignSessionsRealTrace(b *testing.B) {
	reqs := loadReal(b)
	ids := 0
	for _, r := range reqs {
		ids += len(r.HashIDs)
	}
	b.ReportAllocs()
	for b.Loop() {
		trace.AssignSessions(reqs)
	}
	b.ReportMetric(float64(b.N)*float64(ids)/b.Elapsed().Seconds()/1e6, "Mids/s")
}

func BenchmarkLoadRealTrace(b *testing.B) {
	loadReal(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := trace.Load(realTrace); err != nil {
			b.Fatal(err)
		}
	}
}
