package openai

import "bytes"

// The usage keys the proxy reads, as indexes into usage's arrays.
const (
	usageCompletion = iota // completionTokensKey
	usageOutput            // outputTokensKey
	usageCached            // cachedTokensKey
	usageCacheRead         // cacheReadTokensKey
	usageKeys
)

// usageKeyNames are the usage keys, by index.
var usageKeyNames = [usageKeys]string{completionTokensKey, outputTokensKey, cachedTokensKey, cacheReadTokensKey}

// usageTail ends every usage key.
const usageTail = `_tokens"`

// usage is what one chunk of an answer says of each usage key: for each, the number after
// the key's last occurrence, if a number follows it.
type usage struct {
	n  [usageKeys]int
	ok [usageKeys]bool
}

// scanUsage finds the last `key: N` of each usage key in b (a whole answer, or one read of a
// stream, where the usage chunk comes last). It is a scan, not a parse: the numbers only feed
// a metric and the index's estimate of what the worker caches. Each key ends in `_tokens"`,
// so one forward search for that finds every occurrence of every key, where a search per key
// would read the chunk four times.
func scanUsage(b []byte) usage {
	var last [usageKeys]int
	for k := range last {
		last[k] = -1
	}
	// Each pass finds a later occurrence of the tail or ends.
	for off := 0; ; {
		i := bytes.Index(b[off:], []byte(usageTail))
		if i < 0 {
			break
		}
		end := off + i // where the tail starts
		for k, key := range usageKeyNames {
			pre := key[:len(key)-len(usageTail)]
			if end >= len(pre) && string(b[end-len(pre):end]) == pre {
				last[k] = end - len(pre)
				break
			}
		}
		off = end + 1
	}
	var u usage
	for k, at := range last {
		if at >= 0 {
			u.n[k], u.ok[k] = usageValue(b[at+len(usageKeyNames[k]):])
		}
	}
	return u
}

// usageValue reads ": N" at the start of rest, the text after a usage key.
func usageValue(rest []byte) (int, bool) {
	rest = bytes.TrimLeft(rest, " \t\r\n")
	if len(rest) == 0 || rest[0] != ':' {
		return 0, false
	}
	rest = bytes.TrimLeft(rest[1:], " \t\r\n")
	n, digits := 0, 0
	for _, ch := range rest {
		if ch < '0' || ch > '9' || digits >= 12 {
			break
		}
		n = n*10 + int(ch-'0')
		digits++
	}
	return n, digits > 0
}
