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

// usageTail ends every usage key, and usagePrefixes are what comes before it in each.
var (
	usageTail     = []byte(`_tokens"`)
	usagePrefixes = [usageKeys][]byte{[]byte(`"completion`), []byte(`"output`), []byte(`"cached`), []byte(`"cache_read_input`)}
)

// usage is what one chunk of an answer says of each usage key: usageCount's answer for it.
type usage struct {
	n  [usageKeys]int
	ok [usageKeys]bool
}

// scanUsage reads every usage key of b in one pass: for each key, usageCount(b, key). Each
// key ends in `_tokens"`, so one search for that finds every occurrence of every key, where
// usageCount searches the whole chunk once per key.
func scanUsage(b []byte) usage {
	var last [usageKeys]int
	for k := range last {
		last[k] = -1
	}
	// Each pass finds a later occurrence of the tail or ends.
	for off := 0; ; {
		i := bytes.Index(b[off:], usageTail)
		if i < 0 {
			break
		}
		end := off + i // where the tail starts
		for k, pre := range usagePrefixes {
			if end >= len(pre) && bytes.Equal(b[end-len(pre):end], pre) {
				last[k] = end - len(pre)
				break
			}
		}
		off = end + 1
	}
	var u usage
	for k, at := range last {
		if at >= 0 {
			u.n[k], u.ok[k] = usageValue(b[at+len(usagePrefixes[k])+len(usageTail):])
		}
	}
	return u
}

// usageValue reads ": N" at the start of rest, as usageCount does after its key.
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
