package main

import (
	"context"
	"fmt"

	"github.com/settle-go/settle/outbox"
	"github.com/settle-go/settle/parked"
	"github.com/settle-go/settle/sqldb"
)

// defaultParkedTable is the default of -table of the parked commands:
// parked.Config.Table's.
const defaultParkedTable = "settle_parked"

// parkedStore is what the commands use of a parked.Store, whatever its
// driver's transaction type; replay, which takes an outbox of the same
// driver, is a method of the database (replayParked).
type parkedStore interface {
	Check(ctx context.Context) error
	Get(ctx context.Context, id int64) (parked.Message, error)
	List(ctx context.Context, q parked.Query) (parked.Page, error)
	Count(ctx context.Context, f parked.Filter) (int64, error)
	Groups(ctx context.Context, f parked.Filter) ([]parked.Group, error)
	Preview(ctx context.Context, f parked.Filter, opts parked.ReplayOptions) (parked.ReplayResult, error)
	Archive(ctx context.Context, f parked.Filter, by string) (int64, error)
	Purge(ctx context.Context, f parked.Filter) (int64, error)
}

// parkedOn returns the constructors of the parked store and of its replay
// on db, for database (see on).
func parkedOn[TTx any](db sqldb.Driver[TTx]) (
	newParked func(parked.Config) (parkedStore, error),
	replay func(ctx context.Context, s parkedStore, outboxTopic string, f parked.Filter, opts parked.ReplayOptions) (parked.ReplayResult, error),
) {
	newParked = func(cfg parked.Config) (parkedStore, error) {
		s, err := parked.New(db, cfg)
		if err != nil {
			return nil, err
		}
		return s, nil
	}
	replay = func(ctx context.Context, s parkedStore, outboxTopic string, f parked.Filter, opts parked.ReplayOptions) (parked.ReplayResult, error) {
		ps, ok := s.(*parked.Store[TTx])
		if !ok {
			return parked.ReplayResult{}, fmt.Errorf("the parked store is a %T, not of the database's driver", s)
		}
		ob, err := outbox.New(db, outbox.Config{Topic: outboxTopic})
		if err != nil {
			return parked.ReplayResult{}, fmt.Errorf("-outbox: %w", err)
		}
		return ps.Replay(ctx, ob, f, opts)
	}
	return newParked, replay
}
