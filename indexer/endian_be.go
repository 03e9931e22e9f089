//go:build !(386 || amd64 || arm || arm64 || loong64 || mips64le || mipsle || ppc64le || riscv64 || wasm)

package indexer

// littleEndian reports that tokens are already little-endian in memory, so a block's bytes
// can be hashed in place.
const littleEndian = false
