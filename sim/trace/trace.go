// Package trace reads Mooncake-format request traces and derives what a
// replay needs from them: token prompts, inferred sessions and the
// unlimited-cache hit ceiling.
//
// A trace line is {"timestamp": ms, "input_length": n, "output_length": m,
// "hash_ids": [...]}, one id per 512-token block of the prompt. Equal ids
// mean equal prompt blocks, always as a shared run from the start of the
// prompt, so prefix structure is all a trace carries; no text, no tokens.
package trace

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"time"
)

// BlockTokens is the number of prompt tokens one hash id stands for in a
// Mooncake trace.
const BlockTokens = 512

// Limits that reject absurd lines before they cost memory or overflow.
const (
	// MaxInputLength caps a request's prompt length in tokens.
	MaxInputLength = 2_000_000
	// MaxOutputLength caps a request's output length in tokens.
	MaxOutputLength = 10_000_000
	// MaxTimestamp caps an arrival time; a year keeps Duration far from overflow.
	MaxTimestamp = 365 * 24 * time.Hour
	// maxLineBytes bounds one JSONL line: a maximal prompt has 3,907 ids of at
	// most 20 digits each, well under 1 MiB.
	maxLineBytes = 1 << 20
)

// Request is one trace entry.
type Request struct {
	// Index is the request's position among the trace's requests (blank
	// lines not counted), starting at 0.
	Index int
	// Timestamp is the arrival time from the start of the trace.
	Timestamp time.Duration
	// InputLength is the prompt length in tokens.
	InputLength int
	// OutputLength is the number of tokens to generate.
	OutputLength int
	// HashIDs holds one id per BlockTokens-token block of the prompt; the last
	// block may be partial.
	HashIDs []uint64
	// Session is the conversation the request belongs to, set by
	// AssignSessions; empty until then.
	Session string
}

// line is the wire shape of one trace line. Pointers tell a missing field
// from a zero one.
type line struct {
	Timestamp    *float64 `json:"timestamp"`
	InputLength  *int64   `json:"input_length"`
	OutputLength *int64   `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
}

// Read decodes a JSONL trace. Blank lines are skipped; any malformed line
// fails the whole read with an error naming its line number, because a
// silently shortened trace would skew every figure computed from it.
func Read(r io.Reader) ([]Request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), maxLineBytes)
	var reqs []Request
	lineNo := 0
	for sc.Scan() {
		lineNo++
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 {
			continue
		}
		req, err := parseLine(text)
		if err != nil {
			return nil, fmt.Errorf("trace line %d: %w", lineNo, err)
		}
		req.Index = len(reqs)
		reqs = append(reqs, req)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, fmt.Errorf("trace line %d: longer than %d bytes: %w", lineNo+1, maxLineBytes, err)
		}
		return nil, fmt.Errorf("trace line %d: %w", lineNo+1, err)
	}
	return reqs, nil
}

func parseLine(text []byte) (Request, error) {
	var l line
	if err := json.Unmarshal(text, &l); err != nil {
		return Request{}, fmt.Errorf("bad JSON: %w", err)
	}
	switch {
	case l.Timestamp == nil:
		return Request{}, errors.New("missing timestamp")
	case l.InputLength == nil:
		return Request{}, errors.New("missing input_length")
	case l.OutputLength == nil:
		return Request{}, errors.New("missing output_length")
	}
	ts := *l.Timestamp
	if ts < 0 || ts > float64(MaxTimestamp/time.Millisecond) {
		return Request{}, fmt.Errorf("timestamp %v ms outside [0, %d]", ts, MaxTimestamp/time.Millisecond)
	}
	in, out := *l.InputLength, *l.OutputLength
	if in < 1 || in > MaxInputLength {
		return Request{}, fmt.Errorf("input_length %d outside [1, %d]", in, MaxInputLength)
	}
	if out < 0 || out > MaxOutputLength {
		return Request{}, fmt.Errorf("output_length %d outside [0, %d]", out, MaxOutputLength)
	}
	if want := BlockCount(int(in)); len(l.HashIDs) != want {
		return Request{}, fmt.Errorf("%d hash_ids for input_length %d, want ceil(%d/%d) = %d",
			len(l.HashIDs), in, in, BlockTokens, want)
	}
	return Request{
		Timestamp:    time.Duration(math.Round(ts * float64(time.Millisecond))),
		InputLength:  int(in),
		OutputLength: int(out),
		HashIDs:      l.HashIDs,
	}, nil
}

// Load reads the JSONL trace at path.
func Load(path string) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("open trace: %w", err)
	}
	defer f.Close()
	reqs, err := Read(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return reqs, nil
}

// BlockCount is the number of BlockTokens-token blocks, the last possibly
// partial, that a prompt of n tokens spans.
func BlockCount(n int) int {
	if n <= 0 {
		return 0
	}
	return (n + BlockTokens - 1) / BlockTokens
}

// Token ids fall in [tokenBase, tokenBase+tokenSpan): clear of the ids
// tokenizers reserve for special tokens at the bottom and inside any common
// vocabulary (Qwen's is about 151k).
const (
	tokenBase = 1000
	tokenSpan = 150_000
)

// Tokens returns the prompt of req as pseudo-token ids, reusing dst's
// storage. Block id b contributes blockTokens tokens, token j of it a fixed
// mix of (b, j), so the same id always yields the same tokens and the trace's
// prefix sharing carries over to any router block size dividing blockTokens.
// The result is truncated to req.InputLength (the partial last block). A
// blockTokens of 0 or less means BlockTokens.
func Tokens(req Request, blockTokens int, dst []uint32) []uint32 {
	if blockTokens <= 0 {
		blockTokens = BlockTokens
	}
	n := max(0, min(req.InputLength, len(req.HashIDs)*blockTokens))
	dst = dst[:0]
	if cap(dst) < n {
		dst = make([]uint32, 0, n)
	}
	for _, b := range req.HashIDs {
		if len(dst) == n {
			break
		}
		seed := mix64(b)
		k := min(blockTokens, n-len(dst))
		for j := range k {
			dst = append(dst, token(seed, uint64(j)))
		}
	}
	return dst
}

// token maps (block seed, position) into the token range. The multiply-high
// reduction avoids the modulo bias toward small ids.
func token(seed, j uint64) uint32 {
	z := mix64(seed + (j+1)*0x9e3779b97f4a7c15)
	return tokenBase + uint32(((z>>32)*tokenSpan)>>32)
}

// mix64 is the splitmix64 finaliser: a bijection on uint64 with good
// avalanche, so neighbouring ids and positions give unrelated outputs.
func mix64(z uint64) uint64 {
	z ^= z >> 30
	z *= 0xbf58476d1ce4e5b9
	z ^= z >> 27
	z *= 0x94d049bb133111eb
	z ^= z >> 31
	return z
}

// chainKey identifies the first n ids of a prompt by a rolling hash; n is
// kept beside the hash so prefixes of different lengths never meet.
type chainKey struct {
	n int
	h uint64
}

// fullChain is how many of req's ids describe whole blocks: a partial last
// block cannot be continued by a later turn, whose block at that position
// holds the full text.
func fullChain(req Request) int {
	n := len(req.HashIDs)
	if n > 0 && req.InputLength%BlockTokens != 0 {
		n--
	}
	return n
}

// AssignSessions sets every request's Session, treating reqs as a trace in arrival order.
// A request continues the session of an earlier request whose whole-block ids it begins with
// (the longest such earlier chain wins, ties go to the most recent), unless that chain is a
// shared prefix: one the trace continues in two or more ways (a system prompt, or any other
// opening that several conversations share). A conversation's next turn extends its previous
// prompt, which one conversation continues one way; a new conversation that opens with the
// same system prompt continues it another way, and so starts a session of its own. Any other
// request starts session "s<Index>". It runs in time linear in the total number of ids.
//
// Without the shared-prefix rule, a short first turn that is nothing but a shared system
// prompt became a session that every later request opening with that prompt continued: on a
// trace whose conversations all open with one system block, 4,000 requests made 17 sessions.
func AssignSessions(reqs []Request) {
	shared := sharedPrefixes(reqs)
	// latest maps a whole-block chain to the most recent request ending there.
	latest := make(map[chainKey]int, len(reqs))
	var keys []chainKey
	for i := range reqs {
		ids := reqs[i].HashIDs
		reqs[i].Session = "s" + strconv.Itoa(reqs[i].Index)
		keys = chainKeys(ids, keys)
		for k := len(ids); k >= 1; k-- {
			if shared[keys[k-1]] {
				continue
			}
			j, ok := latest[keys[k-1]]
			if ok && equalIDs(reqs[j].HashIDs[:k], ids[:k]) {
				reqs[i].Session = reqs[j].Session
				break
			}
		}
		if n := fullChain(reqs[i]); n > 0 {
			latest[keys[n-1]] = i
		}
	}
}

// sharedPrefixes marks every chain that the trace continues with two or more different next
// whole blocks: the branch points of its prefix tree. A partial last block continues nothing:
// the next turn of the same conversation fills that position with its longer text, another id.
func sharedPrefixes(reqs []Request) map[chainKey]bool {
	next := make(map[chainKey]uint64)
	shared := make(map[chainKey]bool)
	var keys []chainKey
	for i := range reqs {
		ids := reqs[i].HashIDs
		keys = chainKeys(ids, keys)
		for k := 1; k < fullChain(reqs[i]); k++ {
			key := keys[k-1]
			if shared[key] {
				continue
			}
			if id, ok := next[key]; !ok {
				next[key] = ids[k]
			} else if id != ids[k] {
				shared[key] = true
			}
		}
	}
	return shared
}

// chainKeys returns the keys of ids[:1], ids[:2], ... ids[:len(ids)],
// reusing dst's storage.
func chainKeys(ids []uint64, dst []chainKey) []chainKey {
	dst = dst[:0]
	var h uint64
	for i, id := range ids {
		h = mix64(h*0x100000001b3 ^ mix64(id+0x9e3779b97f4a7c15))
		dst = append(dst, chainKey{n: i + 1, h: h})
	}
	return dst
}

func equalIDs(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// Ceiling is the prefix hit ratio of one unlimited cache that sees the trace
// in order: a request hits its leading run of blocks whose ids appeared in
// any earlier request. blockRatio counts blocks; tokenRatio counts tokens,
// a partial last block weighing its real size. No router over separate,
// finite worker caches can beat it. An empty trace gives 0, 0.
func Ceiling(reqs []Request) (blockRatio, tokenRatio float64) {
	seen := make(map[uint64]struct{})
	var blocks, hitBlocks, tokens, hitTokens int64
	for _, req := range reqs {
		ids := req.HashIDs
		hit := 0
		for hit < len(ids) {
			if _, ok := seen[ids[hit]]; !ok {
				break
			}
			hit++
		}
		blocks += int64(len(ids))
		hitBlocks += int64(hit)
		tokens += int64(req.InputLength)
		hitTokens += int64(min(req.InputLength, hit*BlockTokens))
		for _, id := range ids {
			seen[id] = struct{}{}
		}
	}
	if blocks > 0 {
		blockRatio = float64(hitBlocks) / float64(blocks)
	}
	if tokens > 0 {
		tokenRatio = float64(hitTokens) / float64(tokens)
	}
	return blockRatio, tokenRatio
}

// ForReplay reads the trace at path, or the bundled one when path is "", assigns sessions,
// and returns it from request start on.
func ForReplay(path string, start int) ([]Request, error) {
	var reqs []Request
	var err error
	if path == "" {
		reqs, err = Bundled()
	} else {
		reqs, err = Load(path)
	}
	if err != nil {
		return nil, err
	}
	AssignSessions(reqs)
	if start < 0 || start >= len(reqs) {
		return nil, fmt.Errorf("--start %d outside the trace's %d requests", start, len(reqs))
	}
	return reqs[start:], nil
}
