// Package layout holds no code: its test checks that the module's packages import one
// another only in the directions DESIGN.md section 4 (and the README's architecture table)
// allow.
package layout
