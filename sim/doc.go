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
// reply reproduces the exact token ids the worker generated and hits its cache. Each word is
// picked by a hash of every token before it (the prompt's and the words generated so far), so
// a continuation generates what the uninterrupted answer would have: a completion whose
// prompt is the original prompt followed by the first k words, or a chat whose final
// assistant message holds them with continue_final_message true and add_generation_prompt
// false (as vLLM takes a continuation; both true, or a final message not the assistant's, is
// a 400), goes on with word k+1. That is how a router's migration of a stream to another
// worker can be checked for duplicated or missing tokens.
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
// A prefill leg's prompt blocks are also pinned by its KV transfer until a decode worker
// pulls them or KVTransferTimeout passes (see below).
//
// A request's cache_salt (completions and chat completions; a non-empty string, as vLLM
// requires) keys its first block, as vLLM keys it: the first block is hashed from a parent
// derived from the salt, and the chain carries it on, so the same tokens under another salt, or
// none, are other blocks and do not hit. Its KV events carry the salt in the first block's
// extra_keys, where vLLM puts it.
//
// With SlidingWindow = W > 0 the worker is a hybrid-attention model (gpt-oss, Gemma 3): the
// cache has a full-attention group and a sliding-window group of W tokens. Every block is
// stored in both; a block's sliding-window twin is removed once the request that computed it
// has computed W tokens past it (vLLM frees such blocks as the window slides, and its events
// report them when the block is reused; the simulator removes them at once), and both go when
// the block is evicted. The events name their group (group_idx, kv_cache_spec_kind and the
// window), as current vLLM's do. Hits are the full-attention group's; vLLM also needs the
// sliding-window blocks just before the hit's end, which this simulator does not model.
//
// # Latency model
//
// A request first waits for one of MaxRunning running slots (counted as waiting), then spends
// Overhead, then enters a FIFO prefill stage that serves one request at a time for
// uncached prompt tokens x PrefillPerToken. Its first token is sent when prefill ends and one
// more token every DecodePerToken after that. Every simulated duration is divided by Speedup.
// A client that goes away aborts its request at once, freeing its slot and its pins.
//
// With ChunkedPrefillTokens = C > 0 (chunked prefill, as vLLM schedules it), the prefill
// stage and the decode clock are replaced by one engine that runs in steps. A step takes up
// to C uncached prompt tokens from the requests still prefilling, oldest first (the head's
// next chunk, then the next request's if budget is left), and one output token from every
// request that is decoding. It lasts
//
//	(DecodePerToken if any request decodes in it) + (prompt tokens prefilled in it) x PrefillPerToken
//
// so a decode step that shares its step with a prefill chunk is slowed by that chunk's
// prefill time, and with no prefill in progress a decode step is DecodePerToken. A
// request's cache lookup happens when its first chunk is scheduled; its first token comes
// at the end of the step that computes its last chunk, and it decodes from the next step
// on. A lone prefill takes as long as in the FIFO stage. The model is deterministic given
// the order in which requests reach the engine; steps follow a clock, so timer lateness
// does not add up. C = 0 keeps the FIFO model exactly.
//
// Stats.InterTokens and InterTokenSeconds (metrics sim_inter_tokens_total and
// sim_inter_token_seconds_total) count every output token after a request's first and sum
// their simulated inter-token latencies: DecodePerToken each without chunked prefill, the
// step's length with it.
//
// A decode leg (below) spends TransferPerBlock for each pulled block it did not hold
// already, after Overhead and before its prefill.
//
// # Prefill/decode disaggregation
//
// Workers speak the protocol of vLLM's NixlConnector, as a router's P/D proxy drives it.
// Config.Role is both (the default), prefill or decode; every role serves requests without
// kv_transfer_params (or with both flags false) as usual.
//
// A prefill leg is a request with kv_transfer_params {"do_remote_decode": true, ...} (the
// other keys, null, are ignored). A decode-role worker answers it 400 (param
// kv_transfer_params.do_remote_decode, code wrong_role); a streamed one is answered 400
// (param stream), because the params come in the whole answer. It is served as any
// request (lookup, prefill of the uncached tokens, blocks stored, KV events, max_tokens
// tokens generated), and its answer is the usual completion JSON with a top-level
//
//	"kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
//	  "remote_block_ids": [0, 1, 2], "remote_engine_id": "w0-5f0c...", "remote_host": "127.0.0.1",
//	  "remote_port": 8001, "tp_size": 1}
//
// remote_block_ids name the prompt's full blocks held in this worker's cache, in order
// (fewer when the cache had no room, [] for a prompt shorter than a block); the ids are
// the worker's own, given out once in its life, so they name one transfer. remote_engine_id
// is [Worker.EngineID]: Config.ID and a random suffix. remote_host and remote_port are the
// local address the request came in on. Those blocks stay pinned until they are pulled, or
// until KVTransferTimeout (wall clock, default 480 s as vLLM's
// VLLM_NIXL_ABORT_REQUEST_TIMEOUT) passes, or the prefix cache is reset; then they go to
// the LRU and the transfer is gone.
//
// A decode leg is a request with those params, do_remote_prefill true. A prefill-role
// worker answers it 400 (param kv_transfer_params.do_remote_prefill, code wrong_role). The
// params must hold remote_engine_id (a non-empty string), remote_host (a loopback IP
// address, IPv6 with or without brackets, or a host name), remote_port (an integer in
// [1, 65535]), remote_block_ids (an array of distinct non-negative integers) and, if
// given, tp_size 1; a field missing or of the wrong type is answered 400 with param
// kv_transfer_params.<field>, named in the message too. After Overhead the worker looks up
// its own cached prefix of the prompt (that hit, and only it, is the usage's
// prompt_tokens_details.cached_tokens), then pulls every block in remote_block_ids with
// POST http://remote_host:remote_port/sim/kv/pull (a timeout of 30 s; the client leaving
// cancels it). The pulled blocks must be the leading full blocks of the prompt as this
// worker tokenizes it (same token ids, same chained hashes, same block size). A pull that
// fails (unknown, expired or already pulled transfer, another engine, the prefill worker
// unreachable) is answered 400 with code kv_transfer_failed, and pulled blocks of another
// prompt 400 with code kv_transfer_mismatch, both with param kv_transfer_params: like
// vLLM, which fails a request whose KV load failed rather than serving it from nothing.
// Otherwise the transfer takes TransferPerBlock x the pulled blocks not already cached
// here, then stores them in the cache as if computed here (with the same BlockStored
// events), and the request prefills only the rest (at least the last token, as a lookup
// leaves it) and decodes, streamed or not, as usual. Its answer carries X-KV-Transfer-Ms,
// the simulated transfer time in decimal milliseconds ("0" when nothing was pulled). An
// empty remote_block_ids pulls nothing.
//
// Metrics: sim_kv_transfers_total{outcome="ok"|"failed"}, sim_kv_transfer_blocks_total and
// sim_kv_transfer_seconds_total (simulated) on the decode side; sim_kv_transfers_held and
// sim_kv_transfers_released_total{reason="pulled"|"expired"|"cleared"} on the prefill side.
//
// # HTTP API
//
//	POST /v1/completions        prompt: string, token ids, or an array with one of those
//	POST /v1/chat/completions   messages with string or text-part content
//	GET  /v1/models, GET /health, GET /metrics (vLLM metric names, a registry per worker)
//	POST /tokenize              vLLM's shape: {"prompt"} or {"messages"} -> {count, max_model_len, tokens};
//	                            a "model" the worker does not serve is 404 model_not_found, as in vLLM
//	POST /reset_prefix_cache    clears the cache, as vLLM's endpoint does
//	GET|POST /sim/faults        {"error_rate", "stall_rate", "stall": "2s", "refuse", "refuse_for": "1s"};
//	                            a POST changes only the fields it gives
//	GET  /sim/stats             {"id", "role", "engine_id", "stats": Stats, "cache": CacheStats}
//	POST /sim/kv/pull           {"engine_id": "w0-5f0c...", "block_ids": [0, 1]} ->
//	                            {"engine_id", "block_size": 16, "blocks": [{"id": 0,
//	                            "hash": <BlockHash, uint64>, "parent": <uint64, 0 for the
//	                            first>, "tokens": [...]}, ...]}, in the order asked
//
// A pull hands out one held transfer once: block_ids must be a non-empty set of blocks of
// one transfer (any subset of its remote_block_ids), and the pull releases the whole
// transfer. Bad JSON, a missing or mistyped field, repeated ids or ids of two transfers
// are answered 400; an engine_id that is not this worker's 404 (code unknown_engine); ids
// of no held transfer (unknown, expired, already pulled, or dropped by a cache reset) 404
// (code unknown_kv_transfer). Errors use the OpenAI error shape.
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
//     /reset_prefix_cache clears every rank; POST /sim/kv/pull goes to the rank whose
//     engine id it names (each rank is an engine, with an engine id of its own), 404 for
//     none; everything else (/v1/models, /health, /tokenize, /metrics) is rank 0's.
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
