// Package doccheck holds tests of the documentation. The Go snippets of
// docs/getting-started.md are whole files that must compile as shown; the
// files of its whole program (the blocks under a "<!-- file: NAME -->"
// line) are built in a module of their own outside the repository, with
// settle added by the guide's replace recipe, and run against RabbitMQ and
// PostgreSQL.
package doccheck
