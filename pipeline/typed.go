package pipeline

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"reflect"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle/poison"
)

// Codec turns payloads into values and back. JSON is the default; bring your
// own for protobuf or anything else.
type Codec interface {
	Marshal(v any) ([]byte, error)
	Unmarshal(data []byte, v any) error
}

// JSON is the default Codec, encoding/json. By default it is lenient as
// encoding/json is: fields of the payload that the type does not have are
// ignored, so that a producer may add an optional field before every
// consumer knows it. With Strict, such a payload is refused (and so poisoned
// by the typed handlers). Either way, a payload that is not one JSON value of
// a compatible shape is refused.
type JSON struct {
	// Strict refuses payloads with fields the type does not have.
	Strict bool
}

// Marshal implements Codec.
func (JSON) Marshal(v any) ([]byte, error) { return json.Marshal(v) }

// Unmarshal implements Codec.
func (c JSON) Unmarshal(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	if c.Strict {
		dec.DisallowUnknownFields()
	}
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return fmt.Errorf("unexpected data after the JSON value")
	}
	return nil
}

// Message is a decoded message: the body and the Watermill message it came
// in (UUID, metadata, context).
type Message[T any] struct {
	Body T
	*message.Message
}

// Decode decodes msg's payload into a Message[T] with codec (nil means
// JSON). A failure is poison.Decode's error (wrapping poison.ErrDecode): permanent, so the message is
// poisoned on its first delivery instead of retried.
func Decode[T any](codec Codec, msg *message.Message) (Message[T], error) {
	if codec == nil {
		codec = JSON{}
	}
	var m Message[T]
	m.Message = msg
	if err := codec.Unmarshal(msg.Payload, &m.Body); err != nil {
		return m, poison.Decode(typeName[T](), err)
	}
	return m, nil
}

func typeName[T any]() string {
	return reflect.TypeFor[T]().String()
}

// Typed adapts fn to a Watermill handler that decodes each payload first,
// for Pipeline.Handle (or a router of your own). A handler that produces
// (Pipeline.HandleProducing) or a batch function calls Decode itself.
func Typed[T any](codec Codec, fn func(ctx context.Context, m Message[T]) error) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		m, err := Decode[T](codec, msg)
		if err != nil {
			return err
		}
		return fn(msg.Context(), m)
	}
}

// TypedTx adapts fn to a TxFunc that decodes each payload first. TTx is
// the transaction type of the handler's driver (TxConfig.DB).
func TypedTx[T, TTx any](codec Codec, fn func(ctx context.Context, tx TTx, m Message[T], out message.Publisher) error) TxFunc[TTx] {
	return func(ctx context.Context, tx TTx, msg *message.Message, out message.Publisher) error {
		m, err := Decode[T](codec, msg)
		if err != nil {
			return err
		}
		return fn(ctx, tx, m, out)
	}
}

// NewMessage encodes body with codec (nil means JSON) into a new message
// with the given UUID.
func NewMessage(uuid string, codec Codec, body any) (*message.Message, error) {
	if codec == nil {
		codec = JSON{}
	}
	data, err := codec.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("pipeline: encode %T: %w", body, err)
	}
	return message.NewMessage(uuid, data), nil
}
