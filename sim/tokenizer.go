package sim

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// Token ids of the simulated tokenizer.
const (
	// BOSToken is the beginning-of-sequence token added with special tokens on.
	BOSToken uint32 = 1
	// FirstPieceToken is the smallest id a text piece maps to.
	FirstPieceToken uint32 = 1000
	// PieceTokens is how many ids text pieces map onto.
	PieceTokens uint32 = 150000
	// maxPieceRunes splits long runs so that token counts grow with text length.
	maxPieceRunes = 8
)

// ChatMessage is one message of a chat, as the template renders it.
type ChatMessage struct {
	Role    string
	Content string
}

// Tokenize turns text into token ids, with BOSToken first when addSpecial is set. The
// package documentation describes the scheme.
func Tokenize(text string, addSpecial bool) []uint32 {
	out := make([]uint32, 0, len(text)/4+1)
	if addSpecial {
		out = append(out, BOSToken)
	}
	return appendTokens(out, text)
}

// RenderChat renders messages with the fixed chat template, ending with the assistant's
// header when addGenerationPrompt is set.
func RenderChat(msgs []ChatMessage, addGenerationPrompt bool) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|>\n")
		b.WriteString(m.Content)
		b.WriteString("\n")
	}
	if addGenerationPrompt {
		b.WriteString("<|assistant|>\n")
	}
	return b.String()
}

// pieceToken maps one text piece to its token id.
func pieceToken(piece string) uint32 {
	const (
		offset32 = 2166136261
		prime32  = 16777619
	)
	h := uint32(offset32)
	for i := 0; i < len(piece); i++ {
		h ^= uint32(piece[i])
		h *= prime32
	}
	return FirstPieceToken + h%PieceTokens
}

type runeClass uint8

const (
	classSpace runeClass = iota
	classWord
	classPunct
)

func classify(r rune) runeClass {
	switch {
	case unicode.IsSpace(r):
		return classSpace
	case r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
		return classWord
	default:
		// Invalid UTF-8 decodes to RuneError and lands here: every byte sequence tokenizes.
		return classPunct
	}
}

// appendTokens appends the tokens of text's pieces to dst.
func appendTokens(dst []uint32, text string) []uint32 {
	start, runes := -1, 0
	cls := classSpace
	flush := func(end int) {
		if start >= 0 {
			dst = append(dst, pieceToken(text[start:end]))
		}
		start, runes = -1, 0
	}
	for i := 0; i < len(text); {
		r, size := utf8.DecodeRuneInString(text[i:])
		c := classify(r)
		if c != cls || runes == maxPieceRunes {
			flush(i)
		}
		cls = c
		if c != classSpace {
			if start < 0 {
				start = i
			}
			runes++
		}
		i += size
	}
	flush(len(text))
	return dst
}
