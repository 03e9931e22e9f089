package sim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Prefill/decode disaggregation, as vLLM's NixlConnector does it: see the package
// documentation for the protocol. This file holds both sides: the prefill worker keeps a
// prefill leg's prompt blocks pinned as a transfer and hands them out once on POST
// /sim/kv/pull; the decode worker pulls them for a decode leg, checks them against its own
// prompt and stores them in its cache.

// KVPullPath is the endpoint a decode worker pulls a prefill leg's blocks from.
const KVPullPath = "/sim/kv/pull"

// KVTransferHeader is the response header in which a decode leg reports its simulated
// transfer time, in decimal milliseconds.
const KVTransferHeader = "X-KV-Transfer-Ms"

// kvPullTimeout bounds a decode worker's pull (wall clock); the request's context may end
// it sooner.
const kvPullTimeout = 30 * time.Second

// kvParam is the request field, and the prefix of the param a bad one is reported under.
const kvParam = "kv_transfer_params"

// kvParams are a request's kv_transfer_params, as vLLM's NixlConnector reads them.
type kvParams struct {
	// remoteDecode marks a prefill leg: keep the prompt's blocks for a decode worker.
	remoteDecode bool
	// remotePrefill marks a decode leg: pull the prompt's blocks from the prefill worker
	// named by the remote fields.
	remotePrefill bool
	engineID      string
	host          string
	port          int
	blockIDs      []int64
}

// parseKVTransferParams reads kv_transfer_params: nil when absent or null. The remote
// fields are read only for a decode leg (a prefill leg carries them as nulls). It never
// panics, whatever the bytes; an error names the field.
func parseKVTransferParams(raw json.RawMessage) (*kvParams, *apiError) {
	if isNull(raw) {
		return nil, nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, badRequest(kvParam, "kv_transfer_params must be a JSON object")
	}
	p := &kvParams{}
	var aerr *apiError
	if p.remoteDecode, aerr = kvBool(m, "do_remote_decode"); aerr != nil {
		return nil, aerr
	}
	if p.remotePrefill, aerr = kvBool(m, "do_remote_prefill"); aerr != nil {
		return nil, aerr
	}
	if p.remoteDecode && p.remotePrefill {
		return nil, badRequest(kvParam, "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true")
	}
	if !p.remotePrefill {
		return p, nil
	}
	field := func(name string) (json.RawMessage, string, *apiError) {
		param := kvParam + "." + name
		v, ok := m[name]
		if !ok || isNull(v) {
			return nil, param, badRequest(param, "%s is required when do_remote_prefill is true", param)
		}
		return v, param, nil
	}

	v, param, aerr := field("remote_engine_id")
	if aerr != nil {
		return nil, aerr
	}
	if err := json.Unmarshal(v, &p.engineID); err != nil || p.engineID == "" {
		return nil, badRequest(param, "%s must be a non-empty string", param)
	}
	if v, param, aerr = field("remote_host"); aerr != nil {
		return nil, aerr
	}
	if err := json.Unmarshal(v, &p.host); err != nil {
		return nil, badRequest(param, "%s must be a string", param)
	}
	if err := checkRemoteHost(p.host); err != nil {
		return nil, badRequest(param, "%s %q: %v", param, p.host, err)
	}
	p.host = strings.TrimSuffix(strings.TrimPrefix(p.host, "["), "]")
	if v, param, aerr = field("remote_port"); aerr != nil {
		return nil, aerr
	}
	var port int64
	if err := json.Unmarshal(v, &port); err != nil || port < 1 || port > 65535 {
		return nil, badRequest(param, "%s must be an integer in [1, 65535], got %s", param, clip(v))
	}
	p.port = int(port)
	if v, param, aerr = field("remote_block_ids"); aerr != nil {
		return nil, aerr
	}
	if p.blockIDs, aerr = parseBlockIDs(v, param, true); aerr != nil {
		return nil, aerr
	}
	if v, ok := m["tp_size"]; ok && !isNull(v) {
		var tp int64
		if err := json.Unmarshal(v, &tp); err != nil || tp != 1 {
			return nil, badRequest(kvParam+".tp_size", "%s.tp_size must be 1 (this worker's tensor-parallel size), got %s", kvParam, clip(v))
		}
	}
	return p, nil
}

// kvBool reads an optional boolean of kv_transfer_params: absent or null is false.
func kvBool(m map[string]json.RawMessage, name string) (bool, *apiError) {
	v, ok := m[name]
	if !ok || isNull(v) {
		return false, nil
	}
	var b bool
	if err := json.Unmarshal(v, &b); err != nil {
		param := kvParam + "." + name
		return false, badRequest(param, "%s must be a boolean, got %s", param, clip(v))
	}
	return b, nil
}

// parseBlockIDs reads an array of distinct non-negative integer block ids.
func parseBlockIDs(raw json.RawMessage, param string, allowEmpty bool) ([]int64, *apiError) {
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, badRequest(param, "%s must be an array of non-negative integers", param)
	}
	if len(items) == 0 && !allowEmpty {
		return nil, badRequest(param, "%s must not be empty", param)
	}
	ids := make([]int64, len(items))
	seen := make(map[int64]struct{}, len(items))
	for i, it := range items {
		if isNull(it) || json.Unmarshal(it, &ids[i]) != nil || ids[i] < 0 {
			return nil, badRequest(param, "%s[%d] must be a non-negative integer, got %s", param, i, clip(it))
		}
		if _, dup := seen[ids[i]]; dup {
			return nil, badRequest(param, "%s lists block %d twice", param, ids[i])
		}
		seen[ids[i]] = struct{}{}
	}
	return ids, nil
}

// clip shortens a JSON value for an error message.
func clip(v json.RawMessage) string {
	const n = 40
	s := string(bytes.TrimSpace(v))
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// checkRemoteHost accepts a loopback IP address (IPv6 bracketed or not) or a host name.
// Another IP address is refused: the simulated fleet lives on loopback.
func checkRemoteHost(h string) error {
	if h == "" {
		return errors.New("must not be empty")
	}
	lit := h
	if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
		lit = h[1 : len(h)-1]
	}
	if addr, err := netip.ParseAddr(lit); err == nil {
		if !addr.IsLoopback() {
			return errors.New("an IP address must be a loopback one")
		}
		return nil
	}
	if lit != h {
		return errors.New("not an IPv6 address in brackets")
	}
	if len(h) > 253 {
		return errors.New("host name longer than 253 characters")
	}
	for _, label := range strings.Split(strings.TrimSuffix(h, "."), ".") {
		if len(label) == 0 || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return errors.New("not a host name")
		}
		for _, c := range []byte(label) {
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-') {
				return errors.New("not a host name")
			}
		}
	}
	return nil
}

// kvTransferOut is the kv_transfer_params of a prefill leg's answer, with the keys vLLM's
// NixlConnector returns from request_finished: a decode leg sends them back as they are.
type kvTransferOut struct {
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	RemoteBlockIDs  []int64 `json:"remote_block_ids"`
	RemoteEngineID  string  `json:"remote_engine_id"`
	RemoteHost      string  `json:"remote_host"`
	RemotePort      int     `json:"remote_port"`
	TPSize          int     `json:"tp_size"`
}

// pullRequest is the body of POST /sim/kv/pull.
type pullRequest struct {
	EngineID string  `json:"engine_id"`
	BlockIDs []int64 `json:"block_ids"`
}

// pullResponse is the answer of POST /sim/kv/pull: the blocks asked for, in the order
// asked.
type pullResponse struct {
	EngineID  string        `json:"engine_id"`
	BlockSize int           `json:"block_size"`
	Blocks    []pulledBlock `json:"blocks"`
}

// pulledBlock is one block of a pull: its id in the transfer, its chained hash (see
// BlockHash), its parent's hash (0 for a prompt's first block) and its token ids.
type pulledBlock struct {
	ID     int64    `json:"id"`
	Hash   uint64   `json:"hash"`
	Parent uint64   `json:"parent"`
	Tokens []uint32 `json:"tokens"`
}

// decodePullRequest parses a pull body. It never panics, whatever the bytes.
func decodePullRequest(body []byte) (*pullRequest, *apiError) {
	if len(bytes.TrimSpace(body)) == 0 {
		return nil, badRequest("", "request body is empty: expected {\"engine_id\", \"block_ids\"}")
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, badRequest("", "request body must be a JSON object {\"engine_id\", \"block_ids\"}")
	}
	req := &pullRequest{}
	if v, ok := m["engine_id"]; !ok || isNull(v) || json.Unmarshal(v, &req.EngineID) != nil || req.EngineID == "" {
		return nil, badRequest("engine_id", "engine_id must be a non-empty string")
	}
	v, ok := m["block_ids"]
	if !ok || isNull(v) {
		return nil, badRequest("block_ids", "block_ids is required")
	}
	var aerr *apiError
	if req.BlockIDs, aerr = parseBlockIDs(v, "block_ids", false); aerr != nil {
		return nil, aerr
	}
	return req, nil
}

// kvTransfers are a worker's prefill legs whose blocks wait for a decode worker.
type kvTransfers struct {
	mu sync.Mutex
	// next is the next block id to give out: ids are never reused in a worker's life, so
	// a stale id names no newer transfer.
	next int64
	// byBlock maps each held block id to its transfer.
	byBlock map[int64]*heldTransfer
	count   int
}

// heldTransfer is one prefill leg's prompt blocks: ids[i] names seq.blocks[i], and the
// ids are consecutive.
type heldTransfer struct {
	ids   []int64
	seq   *sequence
	timer *time.Timer
}

// holdTransfer keeps seq (a prefill leg's prompt blocks, already pinned) for a decode
// worker until it is pulled or KVTransferTimeout passes, and returns its block ids: none
// for no blocks.
func (w *Worker) holdTransfer(seq *sequence) []int64 {
	if seq == nil {
		return []int64{}
	}
	if len(seq.blocks) == 0 {
		w.cache.release(seq)
		return []int64{}
	}
	t := &heldTransfer{seq: seq, ids: make([]int64, len(seq.blocks))}
	tr := &w.transfers
	tr.mu.Lock()
	for i := range t.ids {
		t.ids[i] = tr.next
		tr.byBlock[tr.next] = t
		tr.next++
	}
	tr.count++
	// Armed under the lock, so that a pull that finds t also finds its timer.
	t.timer = time.AfterFunc(w.cfg.KVTransferTimeout, func() { w.expireTransfer(t) })
	tr.mu.Unlock()
	return slices.Clone(t.ids)
}

// takeTransfer removes and returns the transfer that holds every one of ids; the caller
// releases its blocks.
func (w *Worker) takeTransfer(ids []int64) (*heldTransfer, *apiError) {
	tr := &w.transfers
	tr.mu.Lock()
	defer tr.mu.Unlock()
	t := tr.byBlock[ids[0]]
	for _, id := range ids {
		switch u := tr.byBlock[id]; {
		case u == nil:
			return nil, &apiError{status: http.StatusNotFound, typ: "invalid_request_error", param: "block_ids", code: "unknown_kv_transfer",
				message: fmt.Sprintf("no KV transfer on this worker holds block %d: unknown, expired (after %v) or already pulled", id, w.cfg.KVTransferTimeout)}
		case u != t:
			return nil, badRequest("block_ids", "block_ids belong to more than one KV transfer: pull one prefill leg's blocks at a time")
		}
	}
	tr.removeLocked(t)
	return t, nil
}

func (tr *kvTransfers) removeLocked(t *heldTransfer) {
	for _, id := range t.ids {
		delete(tr.byBlock, id)
	}
	tr.count--
	t.timer.Stop()
}

// expireTransfer hands a transfer nobody pulled in time to the LRU.
func (w *Worker) expireTransfer(t *heldTransfer) {
	tr := &w.transfers
	tr.mu.Lock()
	if tr.byBlock[t.ids[0]] != t {
		tr.mu.Unlock()
		return // pulled or dropped meanwhile
	}
	tr.removeLocked(t)
	tr.mu.Unlock()
	w.cache.release(t.seq)
	w.metrics.kvReleased.WithLabelValues("expired").Inc()
	w.log.Info("KV transfer expired: its blocks were not pulled in time", "blocks", len(t.ids),
		"first_block_id", t.ids[0], "timeout", w.cfg.KVTransferTimeout)
}

// dropTransfers forgets every held transfer (the cache was cleared under them).
func (w *Worker) dropTransfers() {
	tr := &w.transfers
	tr.mu.Lock()
	var all []*heldTransfer
	for id, t := range tr.byBlock {
		if id == t.ids[0] {
			all = append(all, t)
		}
	}
	for _, t := range all {
		tr.removeLocked(t)
	}
	tr.mu.Unlock()
	for _, t := range all {
		w.cache.release(t.seq)
		w.metrics.kvReleased.WithLabelValues("cleared").Inc()
	}
}

// heldTransfers counts the transfers waiting to be pulled.
func (w *Worker) heldTransfers() int {
	w.transfers.mu.Lock()
	defer w.transfers.mu.Unlock()
	return w.transfers.count
}

// handlePull answers POST /sim/kv/pull: the blocks of one held transfer, once; the pull
// releases the transfer's pins whatever the decode side then does with the blocks.
func (w *Worker) handlePull(rw http.ResponseWriter, r *http.Request) {
	body, aerr := w.readBody(rw, r)
	var req *pullRequest
	if aerr == nil {
		req, aerr = decodePullRequest(body)
	}
	if aerr == nil && req.EngineID != w.engineID {
		aerr = &apiError{status: http.StatusNotFound, typ: "invalid_request_error", param: "engine_id", code: "unknown_engine",
			message: fmt.Sprintf("engine_id %q is not this worker's engine (%q)", req.EngineID, w.engineID)}
	}
	var t *heldTransfer
	if aerr == nil {
		t, aerr = w.takeTransfer(req.BlockIDs)
	}
	if aerr != nil {
		writeError(rw, aerr)
		return
	}
	defer w.cache.release(t.seq)
	if !w.cache.live(t.seq) {
		writeError(rw, &apiError{status: http.StatusNotFound, typ: "invalid_request_error", param: "block_ids", code: "unknown_kv_transfer",
			message: "the KV transfer's blocks were dropped by a prefix cache reset"})
		return
	}
	resp := pullResponse{EngineID: w.engineID, BlockSize: w.cfg.BlockSize, Blocks: make([]pulledBlock, len(req.BlockIDs))}
	for i, id := range req.BlockIDs {
		ref := t.seq.blocks[id-t.ids[0]].ref // block refs never change once stored
		resp.Blocks[i] = pulledBlock{ID: id, Hash: ref.Hash, Parent: ref.Parent, Tokens: ref.Tokens}
	}
	w.metrics.kvReleased.WithLabelValues("pulled").Inc()
	w.log.Debug("KV transfer pulled", "blocks", len(req.BlockIDs), "first_block_id", t.ids[0], "from", r.RemoteAddr)
	writeJSON(rw, http.StatusOK, resp)
}

// checkRole refuses the leg of a disaggregated request this worker's role does not serve.
func (w *Worker) checkRole(p *kvParams) *apiError {
	wrong := func(field, leg string) *apiError {
		param := kvParam + "." + field
		return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", param: param, code: "wrong_role",
			message: fmt.Sprintf("this worker's role is %s: it does not serve %s legs (%s true)", w.cfg.Role, leg, param)}
	}
	switch {
	case p == nil:
		return nil
	case p.remotePrefill && w.cfg.Role == RolePrefill:
		return wrong("do_remote_prefill", "decode")
	case p.remoteDecode && w.cfg.Role == RoleDecode:
		return wrong("do_remote_decode", "prefill")
	}
	return nil
}

// advertisedAddr is the host and port a decode worker pulls this request's blocks from:
// the local address the request came in on.
func advertisedAddr(r *http.Request) (string, int) {
	addr := r.Host
	if a, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr); ok {
		addr = a.String()
	}
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return addr, 80
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		port = 80
	}
	if i := strings.IndexByte(host, '%'); i >= 0 {
		host = host[:i] // an IPv6 zone
	}
	return host, port
}

// transferError is a decode leg's failed transfer, answered 400.
func transferError(code, format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", param: kvParam, code: code,
		message: "KV transfer failed: " + fmt.Sprintf(format, args...)}
}

// pullKV is a decode leg's transfer: it pulls the prompt's blocks from the prefill worker,
// checks them against this worker's own prompt, spends TransferPerBlock on each it does
// not hold already, and stores them in seq, the request's hold on its local prefix. A
// failure is an *apiError (answered 400), or the context's error when the client left.
func (w *Worker) pullKV(ctx context.Context, req *genRequest, seq *sequence, res *runResult) error {
	p := req.kv
	res.remotePrefill = true
	if len(p.blockIDs) == 0 {
		// A prompt shorter than a block: the prefill worker held nothing.
		w.metrics.kvTransfers.WithLabelValues("ok").Inc()
		return nil
	}
	pulled, err := w.fetchBlocks(ctx, p)
	code := "kv_transfer_failed"
	if err == nil {
		if err = w.checkPulled(req.prompt, req.cacheSalt, p, pulled); err != nil {
			code = "kv_transfer_mismatch"
		}
	}
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		w.metrics.kvTransfers.WithLabelValues("failed").Inc()
		w.log.Info("KV transfer failed", "remote_engine_id", p.engineID, "remote", net.JoinHostPort(p.host, strconv.Itoa(p.port)), "err", err)
		return transferError(code, "%v", err)
	}
	bs := w.cfg.BlockSize
	k := len(pulled.Blocks)
	// seq's blocks are this goroutine's to read: only its owner stores into it now.
	have := max(len(seq.blocks), w.cache.cachedBlocks(req.prompt[:k*bs], req.cacheSalt))
	missing := max(0, k-have)
	if err := sleepUntil(ctx, time.Now().Add(w.scale(w.cfg.TransferPerBlock, missing))); err != nil {
		return err
	}
	w.cache.store(seq, req.prompt[:k*bs])
	res.transfer = time.Duration(missing) * w.cfg.TransferPerBlock
	w.kvTransfers.Add(1)
	w.kvTransferBlocks.Add(uint64(missing))
	w.kvTransferNanos.Add(int64(res.transfer))
	w.metrics.kvTransfers.WithLabelValues("ok").Inc()
	return nil
}

// fetchBlocks asks the prefill worker for the decode leg's blocks.
func (w *Worker) fetchBlocks(ctx context.Context, p *kvParams) (*pullResponse, error) {
	addr := net.JoinHostPort(p.host, strconv.Itoa(p.port))
	body, err := json.Marshal(pullRequest{EngineID: p.engineID, BlockIDs: p.blockIDs})
	if err != nil {
		return nil, fmt.Errorf("encoding the pull: %w", err)
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+KVPullPath, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("pull from %s: %w", addr, err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := w.pullClient.Do(hreq)
	if err != nil {
		return nil, fmt.Errorf("pull from %s: %w", addr, err)
	}
	defer resp.Body.Close()
	// Room for the largest blocks (4096 tokens) as JSON, and an error body.
	limit := int64(len(p.blockIDs))*(4096*12+128) + 1<<16
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit))
	if err != nil {
		return nil, fmt.Errorf("pull from %s: reading the answer: %w", addr, err)
	}
	if resp.StatusCode != http.StatusOK {
		var e errorBody
		msg := string(data)
		if json.Unmarshal(data, &e) == nil && e.Error.Message != "" {
			msg = e.Error.Message
		}
		return nil, fmt.Errorf("prefill worker %s refused the pull (%s): %s", addr, resp.Status, msg)
	}
	var pr pullResponse
	if err := json.Unmarshal(data, &pr); err != nil {
		return nil, fmt.Errorf("prefill worker %s: bad pull answer: %w", addr, err)
	}
	return &pr, nil
}

// checkPulled verifies that the pulled blocks are the leading full blocks of prompt (under
// cache_salt salt), as this worker tokenizes it: the same ids, tokens and chained hashes.
func (w *Worker) checkPulled(prompt []uint32, salt string, p *kvParams, r *pullResponse) error {
	bs := w.cfg.BlockSize
	switch {
	case r.EngineID != p.engineID:
		return fmt.Errorf("the pull was answered by engine %q, not %q", r.EngineID, p.engineID)
	case r.BlockSize != bs:
		return fmt.Errorf("the prefill worker's block size is %d, this worker's %d", r.BlockSize, bs)
	case len(r.Blocks) != len(p.blockIDs):
		return fmt.Errorf("asked for %d blocks, got %d", len(p.blockIDs), len(r.Blocks))
	case len(r.Blocks) > len(prompt)/bs:
		return fmt.Errorf("the transfer has %d blocks, this prompt only %d full ones: it is another prompt's", len(r.Blocks), len(prompt)/bs)
	}
	var parent uint64
	for i, b := range r.Blocks {
		want := prompt[i*bs : (i+1)*bs]
		hashParent := parent
		if i == 0 {
			hashParent = saltSeed(salt)
		}
		switch {
		case b.ID != p.blockIDs[i]:
			return fmt.Errorf("block %d of the answer is id %d, asked for %d", i, b.ID, p.blockIDs[i])
		case !slices.Equal(b.Tokens, want) || b.Parent != parent || b.Hash != BlockHash(hashParent, want):
			return fmt.Errorf("block %d (id %d) is not this prompt's block %d: the transfer is another prompt's", i, b.ID, i)
		}
		parent = b.Hash
	}
	return nil
}

// transferMs formats a simulated transfer time for KVTransferHeader.
func transferMs(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', -1, 64)
}
