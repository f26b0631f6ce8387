package natsjs

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/nats-io/nats.go"
)

// publisher is watermill-nats' Publisher and its connection, whose
// server's bounds it reports (see NewPublisher).
type publisher struct {
	*wmnats.Publisher
	conn *nats.Conn
}

// NewPublisher connects to cfg.URL (with cfg.NatsOptions) and returns
// watermill-nats' Publisher on that connection, which also tells settle's
// parking middlewares (middleware.ParkConfig.Publisher,
// pipeline.Config.Publisher) the most its NATS server takes in one message,
// so that a dead-letter or poison copy, which adds settle's headers to its
// original's, is made to fit the first time:
//
//   - JetStream refuses a message whose header block (NATS/1.0, then one
//     "key: value" line per header) is over 64 KiB, whatever max_payload;
//   - the server refuses one whose header block and payload together are
//     over its max_payload (1 MiB by default; nats.Conn.MaxPayload).
//
// A copy over either bound leaves out the original's largest headers (see
// middleware.ParkConfig.MaxMetadataBytes); a copy whose payload alone leaves
// no room for settle's headers is published without the payload (see
// middleware.MetaPayloadLeftOut). Room is kept in both bounds for the
// encoding's own bytes and for trace context (traceparent, tracestate,
// baggage: 2 KiB). Pass NewPublisherConfig(url), with NatsOptions appended
// for credentials or TLS. Close closes the connection.
func NewPublisher(cfg wmnats.PublisherConfig, logger watermill.LoggerAdapter) (message.Publisher, error) {
	if cfg.Marshaler == nil {
		return nil, errors.New("natsjs: PublisherConfig.Marshaler is required (use NewPublisherConfig)")
	}
	if cfg.SubjectCalculator == nil {
		cfg.SubjectCalculator = wmnats.DefaultSubjectCalculator
	}
	conn, err := nats.Connect(cfg.URL, cfg.NatsOptions...)
	if err != nil {
		return nil, fmt.Errorf("natsjs: connecting the publisher: %w", err)
	}
	pub, err := wmnats.NewPublisherWithNatsConn(conn, cfg.GetPublisherPublishConfig(), logger)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("natsjs: %w", err)
	}
	return &publisher{Publisher: pub, conn: conn}, nil
}

// Bounds of one message, as NATS counts them.
const (
	// maxHeaderBlock is the largest header block JetStream stores
	// ("header size exceeds maximum allowed of 64k").
	maxHeaderBlock = 1<<16 - 1
	// headerOverhead is what the encoding adds to settle's count of a
	// message's metadata (len(key)+len(value)+6 per entry, and the UUID):
	// "NATS/1.0\r\n" and the closing "\r\n", and the UUID's header name
	// (settle counts each entry's ": " and "\r\n" in its 6 bytes).
	headerOverhead = len("NATS/1.0\r\n\r\n") + len(wmnats.WatermillUUIDHdr) + len(": \r\n")
	// traceRoom is left for the trace context written into a copy after
	// it is measured.
	traceRoom = 2 << 10
)

// MessageLimits returns the most a message's metadata may take, and its
// payload and metadata together, in settle's count (len(key)+len(value)+6
// per entry, and the UUID), on this connection's server: see Publisher.
// The parking middlewares read it before each copy, so that a reconnection
// to a server with another max_payload is followed.
func (p *publisher) MessageLimits() (metadata, total int) {
	metadata = maxHeaderBlock - headerOverhead - traceRoom
	if mp := int(p.conn.MaxPayload()); mp > 0 {
		total = mp - headerOverhead - traceRoom
	}
	return metadata, total
}
