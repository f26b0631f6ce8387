// Package console is a web page over what settle leaves for a person: the
// parked messages (package parked), the outbox's backlog and its rows set
// aside, and the dedupe claims in flight. An application mounts the
// http.Handler that New returns; `settle console` serves the same handler on
// its own.
//
// The pages: the failure groups, with counts, first and last seen and a
// replay or archive of a whole group; a filterable, keyset-paginated list of
// parked messages (handler, topic, outcome, group, state, reason text, UUID,
// dedupe key, time window); one message (metadata, payload, pretty-printed
// when it is JSON, reason, attempts, a link to its trace in Jaeger); the
// parked rows per hour by outcome; the outbox's status and set-aside rows;
// the claims in flight and a lookup of one key ("was order 17 charged by
// handler charge, and when?").
//
// Every action (replay or archive of one message, a selection, a group) goes
// through a confirmation page that says what it will do, from the store's
// Preview: how many messages, to which topics, how many the loop guard
// refuses. The selection is pinned when the page is drawn (the rows that
// failed last before then), so a message parked while the operator reads
// is not replayed unseen.
//
// # Security
//
// The handler assumes nothing of the network it is served on:
//
//   - With Config.Token set, every request must carry it, as an
//     "Authorization: Bearer" header or through the login form, which sets
//     an HttpOnly, SameSite=Strict session cookie (a MAC of an expiry, never
//     the token). Tokens are compared in constant time. Without a token the
//     handler serves anyone who can reach it: `settle console` then listens
//     on a loopback address only and serves requests addressed to a
//     loopback name only (a web page of a name pointed at 127.0.0.1, DNS
//     rebinding, is of the console's origin for the browser), and an
//     application that mounts it must put its own authentication in front.
//   - Config.ReadOnly hides every action and refuses every POST but the
//     login.
//   - Every action is a POST carrying a CSRF token derived from the session
//     (an HMAC), and is refused unless its Origin header names the host it
//     was sent to and Sec-Fetch-Site, when sent, says same-origin.
//   - Every value is written through html/template: payloads, reasons and
//     metadata are attacker-controlled and shown as text. Pages carry a
//     Content-Security-Policy that allows only the console's own script and
//     style sheet (served from the binary: no CDN, no external font), and
//     forbid framing; responses are nosniff and no-store, and send a
//     referrer to the console's own pages only (a link to Jaeger does not
//     carry the console's address and filters).
//   - No page and no log line shows the token or a database URL.
//
// # What it does not do
//
// It does not purge rows (settle parked purge does), does not edit a
// message before replaying it, and keeps no record of who did what beyond
// the replayed_by the parked store writes ("console", or the name in
// Config.By).
package console
