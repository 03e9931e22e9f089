package openai

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/poll"
	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// migrationEvent is what the migration tests read of a stream's event.
type migrationEvent struct {
	ID      string `json:"id"`
	Created int64  `json:"created"`
	Choices []struct {
		Text  *string `json:"text"`
		Delta *struct {
			Role    *string `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *struct {
		Prompt     int `json:"prompt_tokens"`
		Completion int `json:"completion_tokens"`
	} `json:"usage"`
	Error *Error `json:"error"`
}

// streamWorker answers a stream in the shape vLLM sends (chat: a role event first; usage
// when asked) with pieces, breaking the connection after them unless whole.
func streamWorker(w http.ResponseWriter, chat bool, id string, created int64, pieces []string, whole bool) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	event := func(v any) {
		b, _ := json.Marshal(v)
		_, _ = fmt.Fprintf(w, "data: %s\n\n", b)
		_ = http.NewResponseController(w).Flush()
	}
	head := map[string]any{"id": id, "created": created, "model": "m"}
	with := func(kv map[string]any) map[string]any {
		out := map[string]any{}
		for k, v := range head {
			out[k] = v
		}
		for k, v := range kv {
			out[k] = v
		}
		return out
	}
	if chat {
		event(with(map[string]any{"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}}}}))
	}
	for i, p := range pieces {
		ch := map[string]any{"index": 0, "finish_reason": nil}
		if whole && i == len(pieces)-1 {
			ch["finish_reason"] = "length"
		}
		if chat {
			ch["delta"] = map[string]any{"content": p}
		} else {
			ch["text"] = p
		}
		event(with(map[string]any{"choices": []any{ch}}))
	}
	if !whole {
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_, _ = buf.WriteString("zz\r\nnot a chunk\r\n")
			_ = buf.Flush()
			_ = conn.Close()
		}
		return
	}
	event(with(map[string]any{"choices": []any{}, "usage": map[string]any{"prompt_tokens": 12, "completion_tokens": len(pieces), "total_tokens": 12 + len(pieces)}}))
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
}

// TestStreamMovesToAnotherWorkerWhenItsWorkerBreaksOff: a stream whose worker breaks off
// after two tokens goes on at the other worker, sent the prompt with the text so far as a
// continuation (max_tokens reduced by what was sent); the client gets one stream with the
// first worker's id and created, every token once, one role event, the usage counting the
// moved tokens as generated; a session is bound to the new worker. Where the request cannot
// be continued, or the stream has moved --migration-limit times, it ends with an error event.
func TestStreamMovesToAnotherWorkerWhenItsWorkerBreaksOff(t *testing.T) {
	forEachServer(t, func(t *testing.T, server string) {
		tests := []struct {
			name string
			path string
			body string
			// limit is --migration-limit; breakAll makes every worker break off, refuse every
			// worker refuse a continuation (400).
			limit            int
			breakAll, refuse bool
			// want: the text the client reads; outcome the migration counted; cont what the
			// continuation carries.
			want    string
			outcome string
			cont    []string
		}{
			{"chat", "/v1/chat/completions", `{"model":"m","stream":true,"max_tokens":4,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"tell"}]}`,
				1, false, false, "Once upon a time", migrationMoved,
				[]string{`"continue_final_message":true`, `"add_generation_prompt":false`, `{"content":"Once upon","role":"assistant"}`, `"max_tokens":2`}},
			{"completions", "/v1/completions", `{"model":"m","stream":true,"max_tokens":4,"stream_options":{"include_usage":true},"prompt":"Start:"}`,
				1, false, false, "Once upon a time", migrationMoved,
				[]string{`"prompt":"Start:Once upon"`, `"max_tokens":2`}},
			{"token prompt", "/v1/completions", `{"model":"m","stream":true,"max_tokens":4,"prompt":[1,2,3]}`,
				1, false, false, "Once upon", migrationUnsupported, nil},
			{"limit reached", "/v1/completions", `{"model":"m","stream":true,"max_tokens":4,"prompt":"Start:"}`,
				1, true, false, "Once upon a", migrationExhausted, nil},
			{"continuation refused", "/v1/completions", `{"model":"m","stream":true,"max_tokens":4,"prompt":"Start:"}`,
				1, false, true, "Once upon", migrationNoWorker, nil},
			{"migration off", "/v1/completions", `{"model":"m","stream":true,"max_tokens":4,"prompt":"Start:"}`,
				0, false, false, "Once upon", migrationDisabled, nil},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				chat := strings.Contains(tt.path, "chat")
				var fws [2]*fakeWorker
				for i := range fws {
					fws[i] = newFakeWorker(t, func(w http.ResponseWriter, _ *http.Request) {
						body, _, _ := fws[i].last()
						switch {
						case !strings.Contains(body, "Once upon"):
							streamWorker(w, chat, fmt.Sprintf("first-%d", i), 111, []string{"Once", " upon"}, false)
						case tt.refuse:
							w.Header().Set("Content-Type", "application/json")
							w.WriteHeader(http.StatusBadRequest)
							_, _ = io.WriteString(w, `{"error":{"message":"no","type":"BadRequestError"}}`)
						case tt.breakAll:
							streamWorker(w, chat, "second", 222, []string{" a"}, false)
						default:
							streamWorker(w, chat, "second", 222, []string{" a", " time"}, true)
						}
					})
				}
				rg := newRig(t, []routing.WorkerSpec{spec("w0", fws[0].URL), spec("w1", fws[1].URL)},
					rigOptions{server: server, front: func(c *Config) { c.MigrationLimit = tt.limit }})
				resp, body := rg.post(tt.path, tt.body, map[string]string{"X-Session-ID": "s1"})
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d: %s", resp.StatusCode, body)
				}
				var text strings.Builder
				var ids []string
				roles, done := 0, false
				var usage, last *migrationEvent
				for ev := range strings.SplitSeq(strings.TrimSpace(body), "\n\n") {
					data := strings.TrimPrefix(ev, "data: ")
					if data == "[DONE]" {
						done = true
						continue
					}
					var e migrationEvent
					if err := json.Unmarshal([]byte(data), &e); err != nil {
						t.Fatalf("event %q: %v", ev, err)
					}
					last = &e
					if e.Error != nil {
						continue
					}
					ids = append(ids, fmt.Sprintf("%s@%d", e.ID, e.Created))
					if e.Usage != nil {
						usage = &e
					}
					for _, c := range e.Choices {
						if c.Text != nil {
							text.WriteString(*c.Text)
						}
						if d := c.Delta; d != nil {
							if d.Role != nil {
								roles++
							}
							if d.Content != nil {
								text.WriteString(*d.Content)
							}
						}
					}
				}
				if text.String() != tt.want {
					t.Errorf("client read %q, want %q; stream:\n%s", text.String(), tt.want, body)
				}
				for _, id := range ids {
					if id != ids[0] {
						t.Errorf("event ids %v: not all the stream's first (%s)", ids, ids[0])
						break
					}
				}
				if got := rg.metric("kvrouter_migrations_total", map[string]string{"outcome": tt.outcome}); got != 1 {
					t.Errorf("migrations{outcome=%s} = %v, want 1", tt.outcome, got)
				}
				if tt.outcome != migrationMoved {
					code := "upstream_broken"
					if tt.refuse {
						code = "migration_failed"
					}
					if done || last == nil || last.Error == nil || last.Error.Code != code {
						t.Fatalf("stream that could not move ends with %+v (done %v), want a %s error event:\n%s", last, done, code, body)
					}
					poll.Holds(t, 10*time.Second, "load to be released", rg.idle)
					return
				}
				if !done || (chat && roles != 1) {
					t.Errorf("done %v, %d role events; want [DONE] and 1 for a chat:\n%s", done, roles, body)
				}
				if usage == nil || usage.Usage.Prompt != 10 || usage.Usage.Completion != 4 {
					t.Errorf("usage %+v, want the 2 moved tokens counted as generated (10 prompt, 4 completion)", usage)
				}
				from, to := fws[0], fws[1]
				if from.requests() != 1 || to.requests() != 1 {
					from, to = to, from
				}
				cont, _, _ := to.last()
				for _, want := range tt.cont {
					if !strings.Contains(cont, want) {
						t.Errorf("continuation %s lacks %s", cont, want)
					}
				}
				b, ok, _ := rg.affinity.Peek(t.Context(), "s1")
				if wantID := map[*fakeWorker]string{fws[0]: "w0", fws[1]: "w1"}[to]; !ok || b.Worker.ID != wantID {
					t.Errorf("session bound to %+v (%v), want the worker the stream moved to, %s", b, ok, wantID)
				}
				poll.Holds(t, 10*time.Second, "load to be released", rg.idle)
			})
		}
	})
}

// TestNextEventCutsWholeEventsInEveryLineEnding: events end at a blank line in "\n", "\r\n"
// or "\r" line endings; a "\r" at the end waits for the byte after it.
func TestNextEventCutsWholeEventsInEveryLineEnding(t *testing.T) {
	tests := []struct {
		in, ev, rest string
		ok           bool
	}{
		{"data: 1\n\ndata: 2", "data: 1\n\n", "data: 2", true},
		{"data: 1\r\n\r\nx", "data: 1\r\n\r\n", "x", true},
		{"data: 1\r\rx", "data: 1\r\r", "x", true},
		{"data: 1\n", "", "data: 1\n", false},
		{"data: 1\r\n\r", "", "data: 1\r\n\r", false},
		{"event: a\ndata: 1\n\n", "event: a\ndata: 1\n\n", "", true},
		{"", "", "", false},
	}
	for _, tt := range tests {
		ev, rest, ok := nextEvent([]byte(tt.in))
		if string(ev) != tt.ev || string(rest) != tt.rest || ok != tt.ok {
			t.Errorf("nextEvent(%q) = %q, %q, %v; want %q, %q, %v", tt.in, ev, rest, ok, tt.ev, tt.rest, tt.ok)
		}
	}
}

// FuzzMigrationRelay: whatever a worker streams, following it and rewriting it as a
// continuation never panics, and a stream followed as it came reaches the client unchanged.
func FuzzMigrationRelay(f *testing.F) {
	f.Add([]byte("data: {\"id\":\"a\",\"created\":1,\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n"), 3)
	f.Add([]byte("data: {\"id\":\"b\",\"choices\":[{\"index\":0,\"text\":\" x\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\r\n\r\ndata: [DONE]\n\n"), 1)
	f.Add([]byte("data: {\"error\":{}}\n\ndata: {\"choices\":[{\"index\":1}]}\n\n"), 7)
	f.Fuzz(func(t *testing.T, stream []byte, cut int) {
		for _, kind := range []Kind{KindChat, KindCompletion} {
			m := newMigration(&Request{Kind: kind, Stream: true, Body: []byte(`{"prompt":"p","messages":[],"max_tokens":9}`)}, 2)
			cut := min(max(cut, 0), len(stream))
			if out := string(m.relay(stream[:cut])) + string(m.relay(stream[cut:])); out != string(stream) {
				t.Fatalf("followed stream changed: %q -> %q", stream, out)
			}
			if _, err := m.continuation([]byte(`{"prompt":"p","messages":[],"max_tokens":9}`)); err != nil {
				t.Fatalf("continuation: %v", err)
			}
			m.moves = 1
			m.start()
			_ = m.relay(stream[:cut])
			_ = m.relay(stream[cut:])
		}
	})
}

// BenchmarkMigrationRelay is what following a stream costs per event with --migration-limit
// above 0 (off, nothing is followed): one vLLM chat chunk of one token, as relayed, and the
// same chunk rewritten as a continuation's.
func BenchmarkMigrationRelay(b *testing.B) {
	ev := []byte(`data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1767225600,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" token"},"logprobs":null,"finish_reason":null}]}` + "\n\n")
	for _, moving := range []bool{false, true} {
		b.Run(fmt.Sprintf("continuation=%v", moving), func(b *testing.B) {
			m := newMigration(&Request{Kind: KindChat, Stream: true, Body: []byte(`{"messages":[]}`)}, 1)
			if moving {
				m.relay(ev)
				m.moves = 1
			}
			b.ReportAllocs()
			b.SetBytes(int64(len(ev)))
			for b.Loop() {
				if m.text.Len() > 1<<20 {
					m.text.Reset()
				}
				m.relay(ev)
			}
		})
	}
}
