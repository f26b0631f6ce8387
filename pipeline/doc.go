// Package pipeline assembles settle's pieces for a Watermill router.
//
// NewTxHandler runs a handler in a database transaction that also confirms
// the message's dedupe key and holds the messages it publishes through the
// transactional outbox: consume, transform and produce, once.
// NewPgxTxHandler does the same in a pgx.Tx (without the outbox, which does
// not run on pgx yet); both run the one transactional flow of this package.
package pipeline
