package parked

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/settle-go/settle/sqldb"
)

// removeChunk is how many rows one transaction of Archive, Prune or Purge
// changes.
const removeChunk = 500

// Archive marks the parked rows f selects archived (by names who) and
// returns how many it archived. Rows in another state are left as they
// are; an archived row is never replayed. Rows go in transactions of at
// most 500, each marking its rows with a token of its own and moving the
// counts of the rows that carry it.
func (s *Store[TTx]) Archive(ctx context.Context, f Filter, by string) (int64, error) {
	if err := f.validate(); err != nil {
		return 0, fmt.Errorf("parked: Archive: %w", err)
	}
	by = cutRunes(clean(by), maxBy)
	var total, after int64
	for {
		var n, last int64
		err := s.inTx(ctx, func(_ TTx, ex sqldb.Executor) error {
			n, last = 0, 0
			b := s.q.build().sql("SELECT id FROM ", s.q.t, " WHERE id > ").arg(after).sql(" AND state = ").arg(string(StateParked))
			s.where(b, f)
			b.sql(" ORDER BY id LIMIT ").arg(removeChunk)
			ids, err := s.ids(ctx, ex, b)
			if err != nil || len(ids) == 0 {
				return err
			}
			last = ids[len(ids)-1]
			now, token := micros(time.Now()), newToken()
			u := s.q.build().sql("UPDATE ", s.q.t, " SET state = ").arg(string(StateArchived)).sql(", archived_at = ").arg(now).
				sql(", archived_by = ").arg(by).sql(", token = ").arg(token).sql(", updated_at = ").arg(now).
				sql(" WHERE id IN ").in(ids).sql(" AND state = ").arg(string(StateParked))
			if _, err := ex.Exec(ctx, u.String(), u.args...); err != nil {
				return err
			}
			// What the UPDATE wrote decides, not how many rows it reports.
			r := s.q.build().sql("SELECT group_id, COUNT(*) FROM ", s.q.t, " WHERE id IN ").in(ids).sql(" AND token = ").arg(token).sql(" GROUP BY group_id")
			deltas := map[string]groupDelta{}
			err = ex.Query(ctx, r.String(), r.args, func(scan func(dest ...any) error) error {
				var g string
				var c int64
				if err := scan(&g, &c); err != nil {
					return err
				}
				deltas[g] = groupDelta{parked: -c}
				n += c
				return nil
			})
			if err != nil {
				return err
			}
			return s.bumpGroups(ctx, ex, deltas)
		})
		if err != nil {
			return total, fmt.Errorf("parked: Archive: %w", err)
		}
		total += n
		if last == 0 {
			return total, nil
		}
		after = last
	}
}

// ids runs b, a query of ids.
func (s *Store[TTx]) ids(ctx context.Context, ex sqldb.Executor, b *builder) ([]int64, error) {
	var ids []int64
	err := ex.Query(ctx, b.String(), b.args, func(scan func(dest ...any) error) error {
		var id int64
		if err := scan(&id); err != nil {
			return err
		}
		ids = append(ids, id)
		return nil
	})
	return ids, err
}

// Prune deletes replayed and archived rows whose last change (the replay,
// the archiving) is before before, and returns how many it deleted. It
// never deletes a parked row. It deletes in transactions of at most 500
// rows, each locking the rows it deletes first and passing over rows
// another transaction holds (a replay in progress): those are left for the
// next prune. The counts of the rows' groups go down with them; a group
// left without a row is deleted.
func (s *Store[TTx]) Prune(ctx context.Context, before time.Time) (int64, error) {
	n, err := s.remove(ctx, func(b *builder) {
		b.sql(" AND state IN (").arg(string(StateReplayed)).sql(", ").arg(string(StateArchived)).
			sql(") AND updated_at < ").arg(micros(before))
	})
	if err != nil {
		return n, fmt.Errorf("parked: Prune: %w", err)
	}
	return n, nil
}

// Purge deletes the rows f selects whose last failure is before f.Until,
// which must be set, and returns how many it deleted. It deletes parked
// rows only when f.State is StateParked: a purge of parked rows is asked for
// by name; with f.State "" it deletes the replayed and archived rows f
// selects. It deletes as Prune does.
func (s *Store[TTx]) Purge(ctx context.Context, f Filter) (int64, error) {
	if f.Until.IsZero() {
		return 0, errors.New("parked: Purge: Filter.Until must be set (rows whose last failure is before it are purged)")
	}
	if err := f.validate(); err != nil {
		return 0, fmt.Errorf("parked: Purge: %w", err)
	}
	n, err := s.remove(ctx, func(b *builder) {
		s.where(b, f)
		if f.State == "" {
			b.sql(" AND state <> ").arg(string(StateParked))
		}
	})
	if err != nil {
		return n, fmt.Errorf("parked: Purge: %w", err)
	}
	return n, nil
}

// remove deletes the rows where cond holds, in locked chunks.
func (s *Store[TTx]) remove(ctx context.Context, cond func(b *builder)) (int64, error) {
	var total int64
	for {
		var n int64
		err := s.inTx(ctx, func(_ TTx, ex sqldb.Executor) error {
			n = 0
			b := s.q.build().sql("SELECT id, group_id, state FROM ", s.q.t, " WHERE 1 = 1")
			cond(b)
			b.sql(" ORDER BY id LIMIT ").arg(removeChunk).sql(s.q.skipLocked)
			var ids []int64
			deltas := map[string]groupDelta{}
			err := ex.Query(ctx, b.String(), b.args, func(scan func(dest ...any) error) error {
				var (
					id           int64
					group, state string
				)
				if err := scan(&id, &group, &state); err != nil {
					return err
				}
				ids = append(ids, id)
				d := deltas[group]
				d.total--
				if State(state) == StateParked {
					d.parked--
				}
				deltas[group] = d
				return nil
			})
			if err != nil || len(ids) == 0 {
				return err
			}
			// The rows are locked (SQLite: the transaction holds the
			// database's write lock): they are deleted as they were read.
			d := s.q.build().sql("DELETE FROM ", s.q.t, " WHERE id IN ").in(ids)
			if _, err := ex.Exec(ctx, d.String(), d.args...); err != nil {
				return err
			}
			n = int64(len(ids))
			return s.bumpGroups(ctx, ex, deltas)
		})
		if err != nil {
			return total, err
		}
		total += n
		if n < removeChunk {
			return total, nil
		}
	}
}
