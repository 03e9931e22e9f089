package sim

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"time"
)

// Defaults for the zero fields of a Config.
const (
	DefaultModel           = "sim-model"
	DefaultID              = "sim"
	DefaultBlockSize       = 16
	DefaultCapacityBlocks  = 65536
	DefaultMaxModelLen     = 131072
	DefaultOverhead        = 5 * time.Millisecond
	DefaultPrefillPerToken = 50 * time.Microsecond
	DefaultDecodePerToken  = 10 * time.Millisecond
	DefaultMaxRunning      = 256
	DefaultMaxBodyBytes    = 32 << 20
	DefaultShutdownTimeout = 5 * time.Second
	// DefaultKVTransferTimeout is vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT.
	DefaultKVTransferTimeout = 480 * time.Second
	DefaultTransferPerBlock  = 20 * time.Microsecond
)

// The roles of a worker in prefill/decode disaggregation (Config.Role).
const (
	// RoleBoth serves every request: plain ones, prefill legs and decode legs.
	RoleBoth = "both"
	// RolePrefill refuses decode legs (kv_transfer_params with do_remote_prefill true).
	RolePrefill = "prefill"
	// RoleDecode refuses prefill legs (kv_transfer_params with do_remote_decode true).
	RoleDecode = "decode"
)

// Request limits, as the OpenAI API and vLLM apply them.
const (
	defaultMaxTokens = 16
	maxMaxTokens     = 4096
)

// Config describes one simulated worker. Zero fields take the defaults above; to make a
// latency negligible, raise Speedup rather than setting it to zero.
type Config struct {
	// ID names the worker; it is sent as the X-Worker-ID response header.
	ID string
	// Model is the served model name.
	Model string
	// LoRAs are the LoRA adapters served on top of Model (vLLM's --lora-modules): requests
	// may name them, and GET /v1/models lists them with Model as their parent.
	LoRAs []string
	// BlockSize is the KV block size in tokens.
	BlockSize int
	// CapacityBlocks is the KV cache size in blocks.
	CapacityBlocks int
	// MaxModelLen bounds prompt tokens plus max_tokens.
	MaxModelLen int
	// Overhead is the fixed part of each request's time to first token.
	Overhead time.Duration
	// PrefillPerToken is the prefill time per uncached prompt token.
	PrefillPerToken time.Duration
	// DecodePerToken is the time between output tokens.
	DecodePerToken time.Duration
	// MaxRunning is how many requests the engine runs at once; more wait in a queue.
	MaxRunning int
	// Speedup divides every simulated duration.
	Speedup float64
	// ErrorRate is the share of requests answered 500.
	ErrorRate float64
	// StallRate is the share of requests that hang before their first byte.
	StallRate float64
	// Stall is how long a stalled request hangs (wall clock); 0 hangs until the client leaves.
	Stall time.Duration
	// Seed seeds the fault draws.
	Seed int64
	// MaxBodyBytes bounds a request body; larger bodies are answered 413.
	MaxBodyBytes int64
	// ShutdownTimeout bounds the graceful part of Serve's shutdown.
	ShutdownTimeout time.Duration
	// Role is the worker's part in prefill/decode disaggregation: RoleBoth (the default,
	// also for ""), RolePrefill or RoleDecode. Requests without kv_transfer_params are
	// served whatever the role.
	Role string
	// KVTransferTimeout is how long a prefill leg's prompt blocks stay pinned for a decode
	// worker to pull them (wall clock, not divided by Speedup, as vLLM's
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT); then they go to the LRU and the transfer is gone.
	KVTransferTimeout time.Duration
	// TransferPerBlock is the simulated time a decode leg takes per prompt block it pulls
	// and did not hold already.
	TransferPerBlock time.Duration
	// ChunkedPrefillTokens, when positive, runs the engine in steps that prefill at most
	// this many prompt tokens each, and a decode step that shares its step with a prefill
	// chunk takes that chunk's prefill time longer (see the package's latency model). 0
	// keeps the separate FIFO prefill stage and the fixed decode rate.
	ChunkedPrefillTokens int
	// SlidingWindow, when positive, makes the worker a hybrid-attention model (gpt-oss,
	// Gemma 3) of this many tokens of sliding window: its KV cache has a full-attention group
	// (group_idx 0) and a sliding-window group (group_idx 1), and every cache event says its
	// group, as current vLLM does (group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window).
	// The sliding-window group stores each block with the full-attention group and removes it
	// once the window of the request that computed it has moved past it, or when the block is
	// evicted. Prefix hits (cached_tokens) are the full-attention group's. 0 is full attention
	// only, with events in the older single-group shape.
	SlidingWindow int
	// Logger receives the worker's logs; nil uses slog.Default().
	Logger *slog.Logger
	// OnEvent, when set, is called in order for every change to the prefix cache. It runs
	// with the cache locked, so it must not block or call back into the Worker.
	OnEvent func(CacheEvent)
}

// withDefaults returns c with every zero field set to its default.
func (c Config) withDefaults() Config {
	if c.ID == "" {
		c.ID = DefaultID
	}
	if c.Model == "" {
		c.Model = DefaultModel
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.CapacityBlocks == 0 {
		c.CapacityBlocks = DefaultCapacityBlocks
	}
	if c.MaxModelLen == 0 {
		c.MaxModelLen = DefaultMaxModelLen
	}
	if c.Overhead == 0 {
		c.Overhead = DefaultOverhead
	}
	if c.PrefillPerToken == 0 {
		c.PrefillPerToken = DefaultPrefillPerToken
	}
	if c.DecodePerToken == 0 {
		c.DecodePerToken = DefaultDecodePerToken
	}
	if c.MaxRunning == 0 {
		c.MaxRunning = DefaultMaxRunning
	}
	if c.Speedup == 0 {
		c.Speedup = 1
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.Role == "" {
		c.Role = RoleBoth
	}
	if c.KVTransferTimeout == 0 {
		c.KVTransferTimeout = DefaultKVTransferTimeout
	}
	if c.TransferPerBlock == 0 {
		c.TransferPerBlock = DefaultTransferPerBlock
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports every field of c that is out of range. Zero fields count as their
// defaults.
func (c Config) Validate() error {
	c = c.withDefaults()
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.BlockSize < 1 || c.BlockSize > 4096 {
		bad("block size %d: must be in [1, 4096]", c.BlockSize)
	}
	if c.CapacityBlocks < 1 {
		bad("capacity %d blocks: must be at least 1", c.CapacityBlocks)
	}
	if c.MaxModelLen < 2 {
		bad("max model len %d: must be at least 2", c.MaxModelLen)
	}
	if c.MaxRunning < 1 {
		bad("max running %d: must be at least 1", c.MaxRunning)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"overhead", c.Overhead}, {"prefill per token", c.PrefillPerToken},
		{"decode per token", c.DecodePerToken}, {"stall", c.Stall},
		{"shutdown timeout", c.ShutdownTimeout}, {"kv transfer timeout", c.KVTransferTimeout},
		{"kv transfer per block", c.TransferPerBlock},
	} {
		if d.v < 0 {
			bad("%s %v: must not be negative", d.name, d.v)
		}
	}
	if math.IsNaN(c.Speedup) || math.IsInf(c.Speedup, 0) || c.Speedup <= 0 {
		bad("speedup %v: must be a positive number", c.Speedup)
	}
	switch c.Role {
	case RoleBoth, RolePrefill, RoleDecode:
	default:
		bad("role %q: must be %s, %s or %s", c.Role, RoleBoth, RolePrefill, RoleDecode)
	}
	if c.SlidingWindow < 0 {
		bad("sliding window %d tokens: must not be negative", c.SlidingWindow)
	}
	if c.ChunkedPrefillTokens < 0 {
		bad("chunked prefill tokens %d: must not be negative", c.ChunkedPrefillTokens)
	}
	if c.MaxBodyBytes < 1 {
		bad("max body bytes %d: must be positive", c.MaxBodyBytes)
	}
	if err := (Faults{ErrorRate: c.ErrorRate, StallRate: c.StallRate, Stall: c.Stall}).Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("sim: invalid config: %w", err)
	}
	return nil
}
