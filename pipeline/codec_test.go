package pipeline_test

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
)

type orderV1 struct {
	ID    int    `json:"id"`
	Email string `json:"email"`
}

// A producer that adds an optional field does not poison the messages of
// consumers not yet upgraded: the JSON codec ignores unknown fields unless
// it is Strict. A payload that is not the type's JSON is poison either way.
func TestJSONIsLenientByDefault(t *testing.T) {
	t.Parallel()
	v2 := []byte(`{"id": 7, "email": "a@example.com", "gift_wrap": true}`)
	m, err := pipeline.Decode[orderV1](nil, message.NewMessage("m", v2))
	if err != nil || m.Body.ID != 7 || m.Body.Email != "a@example.com" {
		t.Fatalf("default codec: %+v, %v; want the known fields decoded", m.Body, err)
	}
	if _, err := pipeline.Decode[orderV1](pipeline.JSON{Strict: true}, message.NewMessage("m", v2)); !settle.IsPermanent(err) {
		t.Fatalf("strict codec: err = %v; want a permanent decode error", err)
	}
	for _, bad := range []string{`{"id": "seven"}`, `[1]`, `{"id": 1} {"id": 2}`, `{`} {
		_, err := pipeline.Decode[orderV1](nil, message.NewMessage("m", []byte(bad)))
		if !errors.Is(err, poison.ErrDecode) {
			t.Errorf("payload %s: err = %v; want a decode error", bad, err)
		}
	}
}
