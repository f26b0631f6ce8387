package parked

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/internal/park"
	"github.com/settle-go/settle/internal/replay"
	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/sqldb"
)

// Bounds of one replay transaction: its rows, and the bytes of their
// payloads and metadata (a row larger than that goes alone).
const (
	replayChunk      = 200
	replayChunkBytes = 16 << 20
)

// maxOutboxTopicMySQL is the longest topic, in characters, an outbox on
// MySQL holds (its topic column is a VARCHAR(255)).
const maxOutboxTopicMySQL = 255

// candidate is a row a replay selected, as it was when selected.
type candidate struct {
	id      int64
	state   State
	replays int
	topic   string
	size    int64
}

// eligible reports whether c is replayed by opts: parked, with a
// destination, and within the loop guard unless forced.
func (s *Store[TTx]) eligible(c candidate, opts ReplayOptions) (ok, refused bool) {
	if c.state != StateParked || opts.Topic == "" && c.topic == "" {
		return false, false
	}
	if s.q.d == sqldb.MySQL && utf8.RuneCountInString(destination(c.topic, opts)) > maxOutboxTopicMySQL {
		// The outbox's topic column could not take the copy: writing it
		// would fail the chunk, and every replay selecting the row.
		return false, false
	}
	if !opts.Force && c.replays >= s.cfg.MaxReplays {
		return false, true
	}
	return true, false
}

// Preview returns what Replay(ctx, ob, f, opts) would do now, changing
// nothing: the same counts and destinations, from the rows as they are.
func (s *Store[TTx]) Preview(ctx context.Context, f Filter, opts ReplayOptions) (ReplayResult, error) {
	if err := f.validate(); err != nil {
		return ReplayResult{}, fmt.Errorf("parked: Preview: %w", err)
	}
	b := s.q.build().sql("SELECT topic, state, replay_count, COUNT(*) FROM ", s.q.t, " WHERE 1 = 1")
	s.where(b, f)
	b.sql(" GROUP BY state, replay_count, topic") // in the order of the preview index
	res := ReplayResult{Destinations: map[string]int64{}}
	err := s.db.DB().Query(ctx, b.String(), b.args, func(scan func(dest ...any) error) error {
		var (
			c     candidate
			state string
			n     int64
		)
		if err := scan(&c.topic, &state, &c.replays, &n); err != nil {
			return err
		}
		c.state = State(state)
		res.add(s.eligibleCount(c, opts, n))
		return nil
	})
	if err != nil {
		return ReplayResult{}, fmt.Errorf("parked: Preview: %w", err)
	}
	return res, nil
}

// eligibleCount is the result of replaying n rows like c.
func (s *Store[TTx]) eligibleCount(c candidate, opts ReplayOptions, n int64) ReplayResult {
	ok, refused := s.eligible(c, opts)
	switch {
	case ok:
		return ReplayResult{Replayed: n, Destinations: map[string]int64{destination(c.topic, opts): n}}
	case refused:
		return ReplayResult{Refused: n}
	}
	return ReplayResult{Skipped: n}
}

func destination(topic string, opts ReplayOptions) string {
	if opts.Topic != "" {
		return opts.Topic
	}
	return topic
}

// add adds r's counts to res.
func (res *ReplayResult) add(r ReplayResult) {
	res.Replayed += r.Replayed
	res.Refused += r.Refused
	res.Skipped += r.Skipped
	for d, n := range r.Destinations {
		if res.Destinations == nil {
			res.Destinations = map[string]int64{}
		}
		res.Destinations[d] += n
	}
}

// Replay replays the parked rows f selects through ob, which must be an
// outbox of the same database: each copy is written in the transaction that
// marks its row replayed, so a row is replayed once, however many replays
// of it run at once, and a replay interrupted (its context cancelled, its
// process killed) and run again replays only the rows it had not
// committed.
//
// Rows go in transactions of at most 200 rows (and 16 MiB of payload and
// metadata), in ID order. Each transaction marks its rows replayed with a
// token of its own, only those still parked (and within the loop guard,
// unless opts.Force), reads back the rows that carry its token, writes their
// copies through ob.TxPublisher and moves the counts of their groups. After
// each commit ob.Notify wakes the relays of this process.
//
// The copy of a row is its message (payload and metadata) without settle's
// failure keys and the broker's, with settle_replay_count (the row's
// replay count, now one more), settle_replayed_at, settle_replay_of (the
// row's UUID), settle_replay_outcome, settle_replay_reason and
// settle_replayed_by (opts.By), under a new UUID derived from the row's UUID
// and its replay count: the settle command's dlq replay derives the same.
// It goes to opts.Topic, or to the topic the row was consumed from.
//
// On an error the result counts the rows of the transactions committed
// before it.
func (s *Store[TTx]) Replay(ctx context.Context, ob *outbox.Outbox[TTx], f Filter, opts ReplayOptions) (ReplayResult, error) {
	res := ReplayResult{Destinations: map[string]int64{}}
	if ob == nil {
		return res, errors.New("parked: Replay: no outbox")
	}
	if err := f.validate(); err != nil {
		return res, fmt.Errorf("parked: Replay: %w", err)
	}
	opts.By = cutRunes(clean(opts.By), maxBy)
	var after int64
	for {
		var c chunk
		err := s.inTx(ctx, func(tx TTx, ex sqldb.Executor) error {
			c = chunk{after: after}
			return s.replayChunk(ctx, ob, tx, ex, f, opts, &c)
		})
		if err != nil && !(c.written && s.committed(ctx, c.marked, c.token)) {
			return res, fmt.Errorf("parked: Replay: %w", err)
		}
		res.add(c.res)
		if c.res.Replayed > 0 {
			ob.Notify()
			s.cfg.Logger.Debug("parked: replayed", watermill.LogFields{"rows": c.res.Replayed, "by": opts.By})
		}
		if opts.Progress != nil && (err == nil || c.res.Replayed > 0) {
			sofar := res
			sofar.Destinations = maps.Clone(res.Destinations)
			opts.Progress(sofar)
		}
		if err != nil {
			// The commit went through, its answer was lost (the
			// context ended while it ran): counted, and stopped there.
			return res, fmt.Errorf("parked: Replay: %w", err)
		}
		if c.done {
			return res, nil
		}
		after = c.last
	}
}

// chunk is one transaction of a replay.
type chunk struct {
	after   int64 // the rows after this id
	res     ReplayResult
	last    int64 // the last id selected
	done    bool  // no rows after last
	token   string
	marked  []int64 // the rows that carry token
	written bool    // every statement ran: only the commit was left
}

// committed reports whether the rows ids carry token, that is whether a
// transaction whose commit returned an error did commit. It asks on a
// context of its own: the replay's may be what ended.
func (s *Store[TTx]) committed(ctx context.Context, ids []int64, token string) bool {
	if len(ids) == 0 {
		return false
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	b := s.q.build().sql("SELECT COUNT(*) FROM ", s.q.t, " WHERE id IN ").in(ids).sql(" AND token = ").arg(token)
	var n int
	return s.db.DB().QueryRow(ctx, b.String(), b.args, &n) == nil && n == len(ids)
}

// replayChunk replays the next rows of f after c.after, in tx, and says
// what it did in c.
func (s *Store[TTx]) replayChunk(ctx context.Context, ob *outbox.Outbox[TTx], tx TTx, ex sqldb.Executor, f Filter, opts ReplayOptions, c *chunk) error {
	res := &c.res
	size := "octet_length(payload) + octet_length(metadata)"
	switch s.q.d {
	case sqldb.MySQL:
		size = "LENGTH(payload) + LENGTH(metadata)"
	case sqldb.SQLite:
		size = "length(payload) + length(CAST(metadata AS BLOB))"
	}
	b := s.q.build().sql("SELECT id, state, replay_count, topic, ", size, " FROM ", s.q.t, " WHERE id > ").arg(c.after)
	s.where(b, f)
	b.sql(" ORDER BY id LIMIT ").arg(s.chunk)
	var cands []candidate
	err := ex.Query(ctx, b.String(), b.args, func(scan func(dest ...any) error) error {
		var cd candidate
		var state string
		if err := scan(&cd.id, &state, &cd.replays, &cd.topic, &cd.size); err != nil {
			return err
		}
		cd.state = State(state)
		cands = append(cands, cd)
		return nil
	})
	if err != nil {
		return err
	}
	if len(cands) == 0 {
		c.last, c.done = c.after, true
		return nil
	}
	// Cut the chunk at its byte bound: the rows after it come in the next.
	done := len(cands) < s.chunk
	var bytes int64
	for i, cd := range cands {
		if bytes += cd.size; i > 0 && bytes > replayChunkBytes {
			cands, done = cands[:i], false
			break
		}
	}
	c.last, c.done = cands[len(cands)-1].id, done

	var ids []int64
	for _, cd := range cands {
		if ok, _ := s.eligible(cd, opts); ok {
			ids = append(ids, cd.id)
		}
	}
	marked := map[int64]Message{}
	if len(ids) > 0 {
		now := time.Now()
		token := newToken()
		c.token = token
		u := s.q.build().sql("UPDATE ", s.q.t, " SET state = ").arg(string(StateReplayed)).
			sql(", replay_count = replay_count + 1, replayed_at = ").arg(micros(now)).
			sql(", replayed_by = ").arg(opts.By).sql(", token = ").arg(token).sql(", updated_at = ").arg(micros(now)).
			sql(" WHERE id IN ").in(ids).sql(" AND state = ").arg(string(StateParked))
		if !opts.Force {
			u.sql(" AND replay_count < ").arg(s.cfg.MaxReplays)
		}
		if opts.Topic == "" {
			u.sql(" AND topic <> ''")
		}
		if _, err := ex.Exec(ctx, u.String(), u.args...); err != nil {
			return fmt.Errorf("marking rows replayed: %w", err)
		}
		// What the UPDATE wrote decides, not how many rows it reports.
		r := s.q.build().sql("SELECT ", rowCols, ", payload, metadata FROM ", s.q.t, " WHERE id IN ").in(ids).sql(" AND token = ").arg(token).sql(" ORDER BY id")
		err := ex.Query(ctx, r.String(), r.args, func(scan func(dest ...any) error) error {
			m, err := scanRow(scan, true)
			if err == nil {
				marked[m.ID] = m
				c.marked = append(c.marked, m.ID)
			}
			return err
		})
		if err != nil {
			return fmt.Errorf("reading back the rows marked: %w", err)
		}
		if err := s.publish(ctx, ob, tx, marked, opts, now); err != nil {
			return err
		}
		deltas := map[string]groupDelta{}
		for _, m := range marked {
			d := deltas[m.Group]
			d.parked--
			deltas[m.Group] = d
		}
		if err := s.bumpGroups(ctx, ex, deltas); err != nil {
			return err
		}
	}
	for _, cd := range cands {
		if m, ok := marked[cd.id]; ok {
			res.add(ReplayResult{Replayed: 1, Destinations: map[string]int64{destination(m.Topic, opts): 1}})
			continue
		}
		if _, refused := s.eligible(cd, opts); refused {
			res.Refused++
		} else {
			res.Skipped++
		}
	}
	c.written = true
	return nil
}

// publish writes the copies of the rows marked through ob in tx, in ID
// order.
func (s *Store[TTx]) publish(ctx context.Context, ob *outbox.Outbox[TTx], tx TTx, marked map[int64]Message, opts ReplayOptions, now time.Time) error {
	if len(marked) == 0 {
		return nil
	}
	pub, err := ob.TxPublisher(tx)
	if err != nil {
		return err
	}
	ids := make([]int64, 0, len(marked))
	for id := range marked {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		m := marked[id]
		cp := replayCopy(ctx, m, opts.By, now)
		dest := destination(m.Topic, opts)
		if err := pub.Publish(dest, cp); err != nil {
			return fmt.Errorf("writing the copy of row %d: %w", id, err)
		}
	}
	return nil
}

// replayCopy is the message that replays row m (whose Replays already
// counts this replay).
func replayCopy(ctx context.Context, m Message, by string, now time.Time) *message.Message {
	md := make(message.Metadata, len(m.Metadata)+6)
	for k, v := range m.Metadata {
		md[k] = v
	}
	for _, k := range replay.DropKeys {
		delete(md, k)
	}
	of := m.UUID
	if of == "" {
		// As the parking middleware names a message without a UUID.
		of = park.Identity(message.NewMessage("", m.Payload))
	}
	md[settle.MetaReplayedAt] = now.UTC().Format(time.RFC3339Nano)
	md[settle.MetaReplayOf] = m.UUID
	md[settle.MetaReplayCount] = strconv.Itoa(m.Replays)
	md[settle.MetaReplayOutcome] = string(m.Outcome)
	md[settle.MetaReplayReason] = cutBytes(m.Reason, park.MaxReason)
	// The copy is for the handler that failed; the others consuming the
	// topic ack it (a forged value on the original was dropped above).
	// (The row's Handler is a scope already: settlement.ScopeOf.)
	if m.Handler != "" {
		md[settle.MetaReplayHandler] = m.Handler
	}
	delete(md, settle.MetaReplayedBy)
	if by != "" {
		md[settle.MetaReplayedBy] = by
	}
	cp := message.NewMessage(replay.UUID(of, m.Handler, m.Replays), m.Payload)
	cp.Metadata = md
	cp.SetContext(ctx)
	return cp
}
