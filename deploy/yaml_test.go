package deploy_test

import (
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

// The module has no YAML library, and the deploy files do not need one: they are written in a
// small subset (block mappings and sequences, one-line flow sequences of scalars, quoted and
// plain scalars, "|" block scalars, "---" between documents, comments). parseYAML reads exactly
// that subset into map[string]any, []any and string (numbers and booleans stay strings) and
// rejects anything outside it (anchors, aliases, tags, folded scalars, multi-line flows, tabs)
// with an error, so a construct it would misread cannot slip into a manifest unnoticed.

// yamlLine is one meaningful source line: its indentation, its text without the comment, and,
// when it opened a block scalar, that scalar's content.
type yamlLine struct {
	num    int
	indent int
	text   string
	block  *string
}

// parseYAML returns the documents of src; empty documents are left out.
func parseYAML(src string) ([]any, error) {
	docs, err := lexYAML(src)
	if err != nil {
		return nil, err
	}
	var out []any
	for _, lines := range docs {
		if len(lines) == 0 {
			continue
		}
		p := &yamlParser{lines: lines}
		if lines[0].indent != 0 {
			return nil, fmt.Errorf("line %d: a document must start at column 0", lines[0].num)
		}
		v, err := p.node(0)
		if err != nil {
			return nil, err
		}
		if p.pos < len(p.lines) {
			return nil, fmt.Errorf("line %d: unexpected %q", p.lines[p.pos].num, p.lines[p.pos].text)
		}
		out = append(out, v)
	}
	return out, nil
}

func lexYAML(src string) ([][]yamlLine, error) {
	raw := strings.Split(strings.ReplaceAll(src, "\r\n", "\n"), "\n")
	var docs [][]yamlLine
	var cur []yamlLine
	for i := 0; i < len(raw); i++ {
		line := strings.TrimRight(raw[i], " ")
		trimmed := strings.TrimLeft(line, " ")
		indent := len(line) - len(trimmed)
		switch {
		case trimmed == "---":
			docs = append(docs, cur)
			cur = nil
			continue
		case strings.HasPrefix(trimmed, "\t"):
			return nil, fmt.Errorf("line %d: tab in indentation", i+1)
		case strings.HasPrefix(trimmed, "%"):
			return nil, fmt.Errorf("line %d: directives are not supported", i+1)
		}
		text, err := stripYAMLComment(trimmed)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", i+1, err)
		}
		text = strings.TrimRight(text, " ")
		if text == "" {
			continue
		}
		l := yamlLine{num: i + 1, indent: indent, text: text}
		if head, keep, ok := blockScalarHead(text); ok {
			var body []string
			bodyIndent := -1
			j := i + 1
			for ; j < len(raw); j++ {
				r := strings.TrimRight(raw[j], " ")
				if strings.TrimSpace(r) == "" {
					body = append(body, "")
					continue
				}
				in := len(r) - len(strings.TrimLeft(r, " "))
				if in <= indent {
					break
				}
				if bodyIndent < 0 {
					bodyIndent = in
				}
				if in < bodyIndent {
					return nil, fmt.Errorf("line %d: block scalar line less indented than its first line", j+1)
				}
				body = append(body, r[bodyIndent:])
			}
			for len(body) > 0 && body[len(body)-1] == "" {
				body = body[:len(body)-1]
			}
			content := strings.Join(body, "\n")
			if keep && content != "" {
				content += "\n"
			}
			l.text, l.block = head, &content
			i = j - 1
		}
		cur = append(cur, l)
	}
	return append(docs, cur), nil
}

// blockScalarHead recognises "key: |", "key: |-", "- |" and "- |-": it returns the line without
// the indicator and whether the scalar keeps its final newline. Folded scalars (">") are
// outside the subset.
func blockScalarHead(text string) (head string, keep, ok bool) {
	for _, ind := range []string{"|-", "|", ">-", ">"} {
		if text == "- "+ind || strings.HasSuffix(text, ": "+ind) {
			if ind[0] == '>' {
				return "", false, false
			}
			return strings.TrimSpace(strings.TrimSuffix(text, ind)), ind == "|", true
		}
	}
	return "", false, false
}

// stripYAMLComment cuts a comment (a # at the start or after a blank, outside quotes).
func stripYAMLComment(s string) (string, error) {
	cut := len(s)
	if q := scanUnquoted(s, func(i int) bool {
		if s[i] == '#' && (i == 0 || s[i-1] == ' ') {
			cut = i
			return true
		}
		return false
	}); q != 0 {
		return "", fmt.Errorf("unterminated %c quote", q)
	}
	return s[:cut], nil
}

// scanUnquoted calls at with the index of each byte of s outside a quoted scalar, in order,
// until at returns true, and returns the quote left open at the end of s (0 if none). A quote
// opens a scalar only where one starts (at the beginning, or after a blank or one of "[,:-"),
// as in YAML, where a quote inside a plain scalar (it's) is just a character. Comments and
// flow sequences share it so that a flow sequence is split with the quoting that decided
// where its line's comment began.
func scanUnquoted(s string, at func(i int) bool) (open byte) {
	var quote byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case quote != 0:
			if c == '\\' && quote == '"' {
				i++
			} else if c == quote {
				quote = 0
			}
		case (c == '"' || c == '\'') && (i == 0 || strings.ContainsRune(" [,:-", rune(s[i-1]))):
			quote = c
		default:
			if at(i) {
				return 0
			}
		}
	}
	return quote
}

type yamlParser struct {
	lines []yamlLine
	pos   int
}

func isSeqItem(text string) bool { return text == "-" || strings.HasPrefix(text, "- ") }

// node parses the mapping or sequence that starts at the current line, at indent.
func (p *yamlParser) node(indent int) (any, error) {
	if isSeqItem(p.lines[p.pos].text) {
		return p.seq(indent)
	}
	return p.mapping(indent)
}

func (p *yamlParser) seq(indent int) ([]any, error) {
	out := []any{}
	for p.pos < len(p.lines) {
		l := &p.lines[p.pos]
		if l.indent < indent || !isSeqItem(l.text) {
			break
		}
		if l.indent > indent {
			return nil, fmt.Errorf("line %d: unexpected indentation", l.num)
		}
		rest := strings.TrimPrefix(l.text, "-")
		sp := len(rest) - len(strings.TrimLeft(rest, " "))
		rest = rest[sp:]
		switch {
		case rest == "" && l.block != nil:
			out = append(out, *l.block)
			p.pos++
		case rest == "":
			p.pos++
			if p.pos < len(p.lines) && p.lines[p.pos].indent > indent {
				v, err := p.node(p.lines[p.pos].indent)
				if err != nil {
					return nil, err
				}
				out = append(out, v)
			} else {
				out = append(out, nil)
			}
		default:
			if _, _, ok := splitYAMLKey(rest); ok {
				// A mapping that starts on the dash line: its keys sit at the column after "- ".
				l.indent, l.text = indent+1+sp, rest
				v, err := p.mapping(l.indent)
				if err != nil {
					return nil, err
				}
				out = append(out, v)
				continue
			}
			v, err := yamlScalar(rest)
			if err != nil {
				return nil, fmt.Errorf("line %d: %w", l.num, err)
			}
			out = append(out, v)
			p.pos++
		}
	}
	return out, nil
}

func (p *yamlParser) mapping(indent int) (map[string]any, error) {
	m := map[string]any{}
	for p.pos < len(p.lines) {
		l := p.lines[p.pos]
		if l.indent < indent {
			break
		}
		if l.indent > indent {
			return nil, fmt.Errorf("line %d: unexpected indentation", l.num)
		}
		if isSeqItem(l.text) {
			return nil, fmt.Errorf("line %d: a sequence item where a key was expected", l.num)
		}
		key, val, ok := splitYAMLKey(l.text)
		if !ok {
			return nil, fmt.Errorf("line %d: want key: value, got %q", l.num, l.text)
		}
		if _, dup := m[key]; dup {
			return nil, fmt.Errorf("line %d: duplicate key %q", l.num, key)
		}
		p.pos++
		switch {
		case val != "":
			v, err := yamlScalar(val)
			if err != nil {
				return nil, fmt.Errorf("line %d: %w", l.num, err)
			}
			m[key] = v
		case l.block != nil:
			m[key] = *l.block
		case p.pos < len(p.lines) && p.lines[p.pos].indent > indent:
			v, err := p.node(p.lines[p.pos].indent)
			if err != nil {
				return nil, err
			}
			m[key] = v
		case p.pos < len(p.lines) && p.lines[p.pos].indent == indent && isSeqItem(p.lines[p.pos].text):
			v, err := p.seq(indent)
			if err != nil {
				return nil, err
			}
			m[key] = v
		default:
			m[key] = nil
		}
	}
	return m, nil
}

// splitYAMLKey splits "key: value" (or "key:") at the first colon followed by a blank or the
// end of the line, outside quotes.
func splitYAMLKey(s string) (key, val string, ok bool) {
	if s == "" || strings.ContainsRune("[{&*!|>", rune(s[0])) {
		return "", "", false
	}
	start := 0
	if s[0] == '"' || s[0] == '\'' {
		end := strings.IndexByte(s[1:], s[0])
		if end < 0 {
			return "", "", false
		}
		start = end + 2
	}
	for i := start; i < len(s); i++ {
		if s[i] != ':' || (i+1 < len(s) && s[i+1] != ' ') {
			continue
		}
		k, err := yamlScalar(s[:i])
		ks, isString := k.(string)
		if err != nil || !isString || ks == "" {
			return "", "", false
		}
		return ks, strings.TrimSpace(s[i+1:]), true
	}
	return "", "", false
}

// yamlScalar reads a one-line value: a quoted or plain scalar, or a flow sequence of scalars.
func yamlScalar(s string) (any, error) {
	switch {
	case s == "~" || s == "null":
		return nil, nil
	case s == "{}":
		return map[string]any{}, nil
	case s[0] == '"':
		if len(s) < 2 || s[len(s)-1] != '"' {
			return nil, fmt.Errorf("bad double-quoted scalar %s", s)
		}
		v, err := strconv.Unquote(s)
		if err != nil {
			return nil, fmt.Errorf("double-quoted scalar %s: %w", s, err)
		}
		return v, nil
	case s[0] == '\'':
		if len(s) < 2 || s[len(s)-1] != '\'' {
			return nil, fmt.Errorf("bad single-quoted scalar %s", s)
		}
		return strings.ReplaceAll(s[1:len(s)-1], "''", "'"), nil
	case s[0] == '[':
		if s[len(s)-1] != ']' {
			return nil, fmt.Errorf("flow sequences must close on their line: %s", s)
		}
		out := []any{}
		inner := strings.TrimSpace(s[1 : len(s)-1])
		if inner == "" {
			return out, nil
		}
		items, err := splitFlow(inner)
		if err != nil {
			return nil, err
		}
		for _, it := range items {
			if it == "" || it[0] == '[' || it[0] == '{' {
				return nil, fmt.Errorf("nested or empty flow items are not supported: %s", s)
			}
			v, err := yamlScalar(it)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
		}
		return out, nil
	case strings.ContainsRune("{&*!|>@`%", rune(s[0])):
		return nil, fmt.Errorf("%q is outside the YAML subset these files use", s)
	}
	return s, nil
}

// splitFlow splits the inside of a flow sequence at commas outside quotes.
func splitFlow(s string) ([]string, error) {
	var out []string
	start := 0
	if q := scanUnquoted(s, func(i int) bool {
		if s[i] == ',' {
			out = append(out, strings.TrimSpace(s[start:i]))
			start = i + 1
		}
		return false
	}); q != 0 {
		return nil, fmt.Errorf("unterminated quote in [%s]", s)
	}
	return append(out, strings.TrimSpace(s[start:])), nil
}

func TestYAMLSubsetReadsWhatTheManifestsUse(t *testing.T) {
	src := `# a comment
apiVersion: v1
spec:
  name: "quoted: value" # trailing comment
  empty:
  list:
    - serve
    - --listen=0.0.0.0:8080
    - "--join=a:1,b:2"
  objs:
    - name: a
      value: 'it''s'
    - name: b
      nested:
        - x
  flow: [one, "two, three", '#four', it's]
  seqAtKeyIndent:
  - p
  - q
  script: |
    line one
      indented # not a comment

  last: http://h:1/p#frag
---
---
kind: Other
`
	got, err := parseYAML(src)
	if err != nil {
		t.Fatal(err)
	}
	want := []any{
		map[string]any{
			"apiVersion": "v1",
			"spec": map[string]any{
				"name":  "quoted: value",
				"empty": nil,
				"list":  []any{"serve", "--listen=0.0.0.0:8080", "--join=a:1,b:2"},
				"objs": []any{
					map[string]any{"name": "a", "value": "it's"},
					map[string]any{"name": "b", "nested": []any{"x"}},
				},
				"flow":           []any{"one", "two, three", "#four", "it's"},
				"seqAtKeyIndent": []any{"p", "q"},
				"script":         "line one\n  indented # not a comment\n",
				"last":           "http://h:1/p#frag",
			},
		},
		map[string]any{"kind": "Other"},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseYAML:\n got %#v\nwant %#v", got, want)
	}
	for name, bad := range map[string]string{
		"anchor":       "a: &x 1\n",
		"alias":        "a: *x\n",
		"tag":          "a: !!str 1\n",
		"folded":       "a: >\n  text\n",
		"tab":          "a:\n\tb: 1\n",
		"indentation":  "a: 1\n  b: 2\n",
		"duplicate":    "a: 1\na: 2\n",
		"open flow":    "a: [1,\n  2]\n",
		"not a key":    "a: 1\njust text\n",
		"unterminated": "a: \"x\n",
	} {
		if v, err := parseYAML(bad); err == nil {
			t.Errorf("%s: parseYAML(%q) = %#v, want an error", name, bad, v)
		}
	}
}
