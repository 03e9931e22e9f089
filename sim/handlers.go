package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// routes builds the worker's HTTP API.
func (w *Worker) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", w.handleGenerate(false))
	mux.HandleFunc("POST /v1/chat/completions", w.handleGenerate(true))
	mux.HandleFunc("POST /v1/responses", w.handleAPI(responsesAPI))
	mux.HandleFunc("POST /v1/messages", w.handleAPI(messagesAPI))
	mux.HandleFunc("POST /v1/messages/count_tokens", w.handleCountTokens)
	mux.HandleFunc("POST /v1/embeddings", w.handleEmbeddings)
	mux.HandleFunc("GET /v1/models", w.handleModels)
	mux.HandleFunc("POST /tokenize", w.handleTokenize)
	mux.HandleFunc("GET /health", func(rw http.ResponseWriter, _ *http.Request) { rw.WriteHeader(http.StatusOK) })
	mux.Handle("GET /metrics", promhttp.HandlerFor(w.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("POST /reset_prefix_cache", func(rw http.ResponseWriter, _ *http.Request) {
		w.ClearCache()
		rw.WriteHeader(http.StatusOK)
	})
	mux.HandleFunc("GET /sim/faults", func(rw http.ResponseWriter, _ *http.Request) {
		writeJSON(rw, http.StatusOK, w.Faults().wire())
	})
	mux.HandleFunc("POST /sim/faults", w.handleSetFaults)
	mux.HandleFunc("GET /sim/stats", func(rw http.ResponseWriter, _ *http.Request) {
		writeJSON(rw, http.StatusOK, struct {
			ID       string     `json:"id"`
			Role     string     `json:"role"`
			EngineID string     `json:"engine_id"`
			Stats    Stats      `json:"stats"`
			Cache    CacheStats `json:"cache"`
		}{w.cfg.ID, w.cfg.Role, w.engineID, w.Stats(), w.Cache()})
	})
	mux.HandleFunc("POST "+KVPullPath, w.handlePull)
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if w.refusing() {
			w.dropConnection(rw)
			return
		}
		rw.Header().Set("X-Worker-ID", w.cfg.ID)
		mux.ServeHTTP(rw, r)
	})
}

// dropConnection closes a request's connection without an answer, as a refusing worker
// does to a client that reuses a kept-alive connection.
func (w *Worker) dropConnection(rw http.ResponseWriter) {
	hj, ok := rw.(http.Hijacker)
	if ok {
		if conn, _, err := hj.Hijack(); err == nil {
			abortConn(conn)
			return
		}
	}
	// Not hijackable (HTTP/2, a recorder): net/http aborts the stream on this panic.
	panic(http.ErrAbortHandler)
}

func writeJSON(rw http.ResponseWriter, status int, v any) {
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(status)
	_ = json.NewEncoder(rw).Encode(v)
}

func writeError(rw http.ResponseWriter, e *apiError) {
	writeJSON(rw, e.status, e.body())
}

// readBody reads a request body up to the configured limit.
func (w *Worker) readBody(rw http.ResponseWriter, r *http.Request) ([]byte, *apiError) {
	body, err := io.ReadAll(http.MaxBytesReader(rw, r.Body, w.cfg.MaxBodyBytes))
	if err == nil {
		return body, nil
	}
	if mbe := (*http.MaxBytesError)(nil); errors.As(err, &mbe) {
		return nil, &apiError{
			status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error",
			message: fmt.Sprintf("request body exceeds %d bytes", mbe.Limit), code: "request_too_large",
		}
	}
	return nil, badRequest("", "reading request body: %v", err)
}

func (w *Worker) handleModels(rw http.ResponseWriter, _ *http.Request) {
	now := time.Now().Unix()
	list := modelList{Object: "list", Data: []modelCard{{
		ID: w.cfg.Model, Object: "model", Created: now, OwnedBy: "sim",
		Root: w.cfg.Model, MaxModelLen: w.cfg.MaxModelLen,
	}}}
	for _, l := range w.cfg.LoRAs {
		list.Data = append(list.Data, modelCard{ID: l, Object: "model", Created: now, OwnedBy: "sim",
			Root: l, Parent: &w.cfg.Model, MaxModelLen: w.cfg.MaxModelLen})
	}
	writeJSON(rw, http.StatusOK, list)
}

func (w *Worker) handleTokenize(rw http.ResponseWriter, r *http.Request) {
	body, aerr := w.readBody(rw, r)
	if aerr == nil {
		var model string
		var tokens []uint32
		if model, tokens, aerr = decodeTokenize(body); aerr == nil {
			// vLLM answers /tokenize only for a model it serves.
			aerr = w.checkModel(model)
		}
		if aerr == nil {
			w.tokenized.Add(1)
			writeJSON(rw, http.StatusOK, tokenizeResponse{Count: len(tokens), MaxModelLen: w.cfg.MaxModelLen, Tokens: tokens})
			return
		}
	}
	writeError(rw, aerr)
}

func (w *Worker) handleSetFaults(rw http.ResponseWriter, r *http.Request) {
	body, aerr := w.readBody(rw, r)
	if aerr != nil {
		writeError(rw, aerr)
		return
	}
	w.faultMu.Lock()
	w.expireRefuseLocked()
	f, err := applyFaultsJSON(w.faults, body)
	if err == nil {
		w.setFaultsLocked(f)
	}
	w.faultMu.Unlock()
	if err != nil {
		writeError(rw, badRequest("", "%v", err))
		return
	}
	w.log.Info("sim faults changed", "error_rate", f.ErrorRate, "stall_rate", f.StallRate,
		"stall", f.Stall, "refuse", f.Refuse, "refuse_for", f.RefuseFor)
	writeJSON(rw, http.StatusOK, f.wire())
}

// checkModel rejects a request for a model this worker does not serve, as vLLM does.
func (w *Worker) checkModel(name string) *apiError {
	if name == "" || name == w.cfg.Model || slices.Contains(w.cfg.LoRAs, name) {
		return nil
	}
	w.wrongModel.Add(1)
	return &apiError{
		status: http.StatusNotFound, typ: "invalid_request_error", param: "model", code: "model_not_found",
		message: fmt.Sprintf("The model `%s` does not exist.", name),
	}
}

func (w *Worker) handleGenerate(chat bool) http.HandlerFunc {
	return func(rw http.ResponseWriter, r *http.Request) {
		start := time.Now()
		body, aerr := w.readBody(rw, r)
		var req *genRequest
		if aerr == nil {
			req, aerr = decodeRequest(body, chat, w.cfg.MaxModelLen)
		}
		if aerr == nil {
			aerr = w.checkModel(req.model)
		}
		if aerr == nil {
			aerr = w.checkRole(req.kv)
		}
		if aerr != nil {
			w.metrics.outcome("rejected")
			writeError(rw, aerr)
			return
		}
		ctx := r.Context()
		switch kind, stall := w.drawFault(); kind {
		case faultError:
			w.failed.Add(1)
			w.metrics.outcome("fault_error")
			writeError(rw, &apiError{status: http.StatusInternalServerError, typ: "server_error",
				message: "simulated worker failure", code: "internal_error"})
			return
		case faultStall:
			w.metrics.outcome("fault_stall")
			if !hang(ctx, stall) {
				w.aborted.Add(1)
				return
			}
		}

		prefix := "cmpl"
		if chat {
			prefix = "chatcmpl"
		}
		out := newOutput(req.prompt, req.maxTokens, chat && !req.continues)
		g := &generation{
			w: w, rw: rw, req: req, out: out, start: start, created: start.Unix(), model: w.cfg.Model,
			id: fmt.Sprintf("%s-%s-%d", prefix, w.cfg.ID, w.nextID.Add(1)),
		}
		emit := g.collect
		if req.stream {
			emit = g.emitStream
		}
		err := w.run(ctx, req, out, emit, &g.res)
		if aerr := (*apiError)(nil); errors.As(err, &aerr) {
			w.metrics.outcome("kv_transfer_failed")
			writeError(rw, aerr)
			return
		}
		if err != nil {
			w.aborted.Add(1)
			w.metrics.outcome("aborted")
			w.metrics.finished.WithLabelValues("abort").Inc()
			w.log.Debug("sim request aborted", "id", g.id, "err", err)
			return
		}
		// Account before the last write, so a client that has its answer sees it counted.
		w.served.Add(1)
		w.metrics.outcome("ok")
		w.metrics.finished.WithLabelValues("length").Inc()
		w.metrics.e2e.Observe(time.Since(start).Seconds())
		if req.stream {
			if err := g.finishStream(); err != nil {
				w.log.Debug("sim stream end not delivered", "id", g.id, "err", err)
			}
			return
		}
		if req.kv != nil && req.kv.remoteDecode {
			// A prefill leg: its prompt blocks wait for the decode worker, which finds them
			// by these params. Held before the answer goes out, so a pull cannot come first.
			host, port := advertisedAddr(r)
			g.kvOut = &kvTransferOut{
				DoRemotePrefill: true, RemoteBlockIDs: w.holdTransfer(g.res.held), RemoteEngineID: w.engineID,
				RemoteHost: host, RemotePort: port, TPSize: 1,
			}
		}
		g.writeWhole()
	}
}

// generation writes one request's answer, whole or streamed.
type generation struct {
	w       *Worker
	rw      http.ResponseWriter
	req     *genRequest
	out     output
	start   time.Time
	id      string
	created int64
	model   string
	res     runResult
	// kvOut is a prefill leg's kv_transfer_params for its answer.
	kvOut *kvTransferOut
}

// setTransferHeader reports a decode leg's simulated transfer time.
func (g *generation) setTransferHeader() {
	if g.res.remotePrefill {
		g.rw.Header().Set(KVTransferHeader, transferMs(g.res.transfer))
	}
}

func (g *generation) object() string {
	switch {
	case g.req.chat && g.req.stream:
		return "chat.completion.chunk"
	case g.req.chat:
		return "chat.completion"
	default:
		return "text_completion"
	}
}

func (g *generation) envelope(choices []choice) response {
	return response{ID: g.id, Object: g.object(), Created: g.created, Model: g.model, Choices: choices}
}

func (g *generation) finishReason(i int) *string {
	if i == len(g.out.pieces)-1 {
		s := "length"
		return &s
	}
	return nil
}

// collect only times the first token: a whole answer is written at the end.
func (g *generation) collect(i int) error {
	if i == 0 {
		g.w.metrics.ttft.Observe(time.Since(g.start).Seconds())
	}
	return nil
}

func (g *generation) writeWhole() {
	text := strings.Join(g.out.pieces, "")
	ch := choice{Index: 0, FinishReason: g.finishReason(len(g.out.pieces) - 1)}
	if g.req.chat {
		ch.Message = &chatMessageOut{Role: "assistant", Content: text}
	} else {
		ch.Text = &text
	}
	resp := g.envelope([]choice{ch})
	resp.Usage = newUsage(len(g.req.prompt), len(g.out.pieces), g.res.cached)
	resp.KVTransferParams = g.kvOut
	g.setTransferHeader()
	writeJSON(g.rw, http.StatusOK, resp)
}

// writeEvent sends one server-sent event and flushes it to the client.
func (g *generation) writeEvent(data []byte) error {
	if _, err := g.rw.Write([]byte("data: ")); err != nil {
		return fmt.Errorf("stream write: %w", err)
	}
	if _, err := g.rw.Write(append(data, '\n', '\n')); err != nil {
		return fmt.Errorf("stream write: %w", err)
	}
	if err := http.NewResponseController(g.rw).Flush(); err != nil {
		return fmt.Errorf("stream flush: %w", err)
	}
	return nil
}

func (g *generation) writeChunk(resp response) error {
	data, err := json.Marshal(resp)
	if err != nil {
		return fmt.Errorf("encode chunk: %w", err)
	}
	return g.writeEvent(data)
}

func (g *generation) emitStream(i int) error {
	if i == 0 {
		g.w.metrics.ttft.Observe(time.Since(g.start).Seconds())
		h := g.rw.Header()
		h.Set("Content-Type", "text/event-stream")
		h.Set("Cache-Control", "no-cache")
		g.setTransferHeader()
		g.rw.WriteHeader(http.StatusOK)
		if g.req.chat {
			if err := g.writeChunk(g.envelope([]choice{{Delta: &chatMessageOut{Role: "assistant"}}})); err != nil {
				return err
			}
		}
	}
	piece := g.out.pieces[i]
	ch := choice{Index: 0, FinishReason: g.finishReason(i)}
	if g.req.chat {
		ch.Delta = &chatMessageOut{Content: piece}
	} else {
		ch.Text = &piece
	}
	return g.writeChunk(g.envelope([]choice{ch}))
}

func (g *generation) finishStream() error {
	if g.req.includeUsage {
		resp := g.envelope([]choice{})
		resp.Usage = newUsage(len(g.req.prompt), len(g.out.pieces), g.res.cached)
		if err := g.writeChunk(resp); err != nil {
			return err
		}
	}
	return g.writeEvent([]byte("[DONE]"))
}

// hang holds a stalled request for d, or until its client leaves when d is 0; it reports
// whether the client is still there.
func hang(ctx context.Context, d time.Duration) bool {
	if d == 0 {
		<-ctx.Done()
		return false
	}
	return sleepUntil(ctx, time.Now().Add(d)) == nil
}
