// Package sim is a simulated OpenAI-compatible inference worker (vLLM-like) that runs on
// loopback without a GPU, so routing quality can be measured by demos, replay benchmarks
// and system tests.
//
// # Tokenizer
//
// The tokenizer is deterministic and needs no vocabulary file. Text is cut into pieces:
// maximal runs of letters, digits and '_' (words), and maximal runs of other non-space
// characters (punctuation); white space only separates pieces. A piece longer than 8 runes
// is split every 8 runes. Each piece becomes the token id 1000 + FNV-1a-32(piece bytes) mod
// 150000, so ids lie in [1000, 151000). With special tokens on (the default, as vLLM's
// add_special_tokens), the BOS token [BOSToken] comes first.
//
// Chat messages are rendered with a fixed template before tokenizing: "<|role|>\ncontent\n"
// per message, then "<|assistant|>\n" when a generation prompt is wanted (the default).
// Two chats that share leading messages therefore share a leading token prefix.
//
// Generated text is a sequence of filler words picked deterministically from the prompt;
// every filler word is a single token, so a follow-up chat turn that repeats the assistant's
// reply reproduces the exact token ids the worker generated and hits its cache.
//
// # Prefix cache
//
// The KV cache is paged in blocks of BlockSize tokens. A block is keyed by the worker's own
// chained hash, FNV-1a-64 over the parent block's hash (8 bytes little endian, 0 for the
// first block) followed by the block's token ids (4 bytes little endian each); see
// [BlockHash]. This is deliberately not the router's xxhash: the router must treat engine
// hashes as opaque, as it must with a real vLLM.
//
// Only full blocks are cached. A request looks up its longest cached prefix when its prefill
// starts, at most (prompt tokens - 1) / BlockSize blocks, because, as in vLLM, the last
// prompt token is always computed. It pins those blocks while it runs, stores its remaining
// full prompt blocks after prefill and, when it finishes normally, the full blocks of prompt
// plus output. Unpinned blocks are evicted least recently used first; a request's blocks are
// released leaf first, so a prefix's tail is evicted before its head. A request that needs
// more blocks than are free caches what fits and never waits for space.
//
// # Latency model
//
// A request first waits for one of MaxRunning running slots (counted as waiting), then spends
// Overhead, then enters a FIFO prefill stage that serves one request at a time for
// uncached prompt tokens x PrefillPerToken. Its first token is sent when prefill ends and one
// more token every DecodePerToken after that. Every simulated duration is divided by Speedup.
// A client that goes away aborts its request at once, freeing its slot and its pins.
//
// # HTTP API
//
//	POST /v1/completions        prompt: string, token ids, or an array with one of those
//	POST /v1/chat/completions   messages with string or text-part content
//	GET  /v1/models, GET /health, GET /metrics (vLLM metric names, a registry per worker)
//	POST /tokenize              vLLM's shape: {"prompt"} or {"messages"} -> {count, max_model_len, tokens}
//	POST /reset_prefix_cache    clears the cache, as vLLM's endpoint does
//	GET|POST /sim/faults        {"error_rate", "stall_rate", "stall": "2s", "refuse", "refuse_for": "1s"};
//	                            a POST changes only the fields it gives
//	GET  /sim/stats             the worker's Stats and CacheStats
//
// Every response carries X-Worker-ID. A single Worker ignores the X-Data-Parallel-Rank and
// X-Session-ID request headers (a DataParallel front reads the rank; see below). A model name
// other than Config.Model is answered 404.
//
// # Data parallelism
//
// [DataParallel] puts one HTTP API in front of several Workers, its ranks, as a vLLM
// deployment with data-parallel size N does: each rank has its own cache, queue, faults,
// metrics and KV events (a [kvevents.Publisher] with DPRank r publishes on the endpoint's
// port + r). The X-Data-Parallel-Rank request header picks the rank:
//
//   - a valid rank r (a non-negative integer below N): rank r's own API serves the request,
//     whatever the path, so /sim/stats, /sim/faults, /metrics and /reset_prefix_cache are
//     that rank's;
//   - not an integer, negative, r >= N, or the header given twice: 400 in the OpenAI error
//     shape, and nothing changes;
//   - absent: a generation request goes to the rank with the fewest requests in flight
//     (running, waiting, or still being read), the lowest rank on a tie, passing over a
//     refusing rank while another serves; GET /sim/stats sums every count over the ranks
//     (capacity too) in the single worker's shape and lists each rank's own under "ranks";
//     GET and POST /sim/faults read and change every rank (a POST sets all ranks or none)
//     and answer with rank 0's faults plus every rank's under "ranks"; POST
//     /reset_prefix_cache clears every rank; everything else (/v1/models, /health,
//     /tokenize, /metrics) is rank 0's.
//
// A response served by one rank carries X-Data-Parallel-Rank with that rank; answers about
// every rank, and 400s for a bad rank, carry none. The front refuses new connections only
// while every rank refuses.
//
// # Faults
//
// A share of requests can be answered 500 (ErrorRate) or hang before their first byte
// (StallRate, for Stall, or until the client leaves when Stall is 0), and the worker can
// refuse connections (Refuse). Stall and RefuseFor are wall-clock durations, not divided by
// Speedup, because they exist to exercise a router's real timeouts. Faults change at run
// time through [Worker.SetFaults] or POST /sim/faults.
package sim
