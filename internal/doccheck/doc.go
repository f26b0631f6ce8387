// Package doccheck holds tests of the documentation: the Go snippets of
// docs/getting-started.md are whole files that must compile as shown.
package doccheck
