package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/middleware"
)

// AttemptsResults: section attempts. The retry middleware's per-process
// memory of failing messages, full: does a delivery ever wait on it?
type AttemptsResults struct {
	Rows []AttemptsRow `json:"rows"`
}

// AttemptsRow is one size of the failure memory.
type AttemptsRow struct {
	Tracked    int     `json:"tracked"`    // RetryConfig.TrackedMessages, and the failing messages in memory
	Deliveries int     `json:"deliveries"` // failed deliveries measured (distinct messages, the memory full)
	Rate       float64 `json:"deliveries_per_s"`
	P50us      float64 `json:"p50_us"` // per failed delivery, in the retry middleware
	P999us     float64 `json:"p999_us"`
	MaxUs      float64 `json:"max_us"`
	OKMaxUs    float64 `json:"ok_max_us"` // the slowest successful delivery running beside them
	// BaseMaxUs is the slowest delivery of the same run with nothing
	// failing (the memory empty): what the machine's scheduling and GC cost
	// on their own.
	BaseMaxUs float64 `json:"base_max_us"`
}

var errBenchFail = errors.New("failed")

// runAttempts fills the failure memory with TrackedMessages distinct failing
// messages and then measures as many more, on two goroutines, while a third
// runs successful deliveries: every failed delivery inserts a record and
// drops the oldest, under the lock that every delivery of a failing message
// takes. The handler does nothing but fail, so the figures are the
// middleware's own.
func runAttempts(ctx context.Context, o options, log io.Writer) (*AttemptsResults, error) {
	sizes := []int{10_000, 100_000}
	res := &AttemptsResults{}
	for _, n := range sizes {
		var rows []AttemptsRow
		for range o.runs {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			r, err := attemptsRound(n, true)
			if err != nil {
				return nil, err
			}
			base, err := attemptsRound(n, false)
			if err != nil {
				return nil, err
			}
			r.BaseMaxUs = base.MaxUs
			fmt.Fprintf(log, "attempts: tracked %d: %s deliveries/s, p99.9 %.1f µs, max %.1f µs, ok max %.1f µs; nothing failing: max %.1f µs\n",
				n, num(r.Rate), r.P999us, r.MaxUs, r.OKMaxUs, r.BaseMaxUs)
			rows = append(rows, r)
		}
		slices.SortFunc(rows, func(a, b AttemptsRow) int { return int(a.MaxUs - b.MaxUs) })
		res.Rows = append(res.Rows, rows[len(rows)/2])
	}
	return res, nil
}

// attemptsRound measures n failing deliveries after n others filled the
// memory; with failing false, the same deliveries succeed.
func attemptsRound(n int, failing bool) (AttemptsRow, error) {
	rt, err := middleware.NewRetry(middleware.RetryConfig{
		MaxAttempts: 1 << 20, NoInProcessRetries: true, InitialInterval: settle.NoDelay, RedeliveryDelay: settle.NoDelay,
		TrackedMessages: n,
	})
	if err != nil {
		return AttemptsRow{}, err
	}
	fail := rt(func(*message.Message) ([]*message.Message, error) {
		if failing {
			return nil, errBenchFail
		}
		return nil, nil
	})
	ok := rt(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	// Fill the memory.
	for i := range n {
		_, _ = fail(message.NewMessage("fill-"+strconv.Itoa(i), nil))
	}
	const workers = 2
	per := n / workers
	lat := make([][]time.Duration, workers)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	var okMax time.Duration
	okDone := make(chan struct{})
	go func() {
		defer close(okDone)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			start := time.Now()
			_, _ = ok(message.NewMessage("ok-"+strconv.Itoa(i), nil))
			okMax = max(okMax, time.Since(start))
		}
	}()
	begin := time.Now()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := make([]time.Duration, 0, per)
			for i := range per {
				msg := message.NewMessage("m-"+strconv.Itoa(w)+"-"+strconv.Itoa(i), nil)
				start := time.Now()
				_, _ = fail(msg)
				l = append(l, time.Since(start))
			}
			lat[w] = l
		}()
	}
	wg.Wait()
	elapsed := time.Since(begin)
	close(stop)
	<-okDone
	all := slices.Concat(lat...)
	slices.Sort(all)
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	return AttemptsRow{
		Tracked:    n,
		Deliveries: len(all),
		Rate:       float64(len(all)) / elapsed.Seconds(),
		P50us:      us(all[len(all)/2]),
		P999us:     us(all[len(all)*999/1000]),
		MaxUs:      us(all[len(all)-1]),
		OKMaxUs:    us(okMax),
	}, nil
}

func attemptsTable(r *AttemptsResults) string {
	if r == nil {
		return "(not measured)\n"
	}
	var b strings.Builder
	b.WriteString("| failing messages tracked | failed deliveries measured | deliveries/s | p50 µs | p99.9 µs | max µs | slowest successful delivery beside them, µs | max µs with nothing failing |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, row := range r.Rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
			num(float64(row.Tracked)), num(float64(row.Deliveries)), num(row.Rate), row.P50us, row.P999us, row.MaxUs, row.OKMaxUs, row.BaseMaxUs)
	}
	return b.String()
}
