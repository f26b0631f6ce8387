package pipeline_test

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/pipeline"
	"github.com/settle-go/settle/poison"
)

// Any payload either decodes into the handler's type, and then encodes and
// decodes back to the same value, or fails with a permanent decode error
// that poisons the message: never a panic, never a half-filled value handed
// to the handler.
func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"id":"A-1","cents":100}`))
	f.Add([]byte(`{"id": 17}`))
	f.Add([]byte(`{"id":"A-1","cents":100,"extra":true}`))
	f.Add([]byte(`{"id":"A-1"} {"id":"A-2"}`))
	f.Add([]byte("\xff\xfe"))
	f.Add([]byte(``))
	f.Fuzz(func(t *testing.T, payload []byte) {
		m, err := pipeline.Decode[order](nil, message.NewMessage("m", payload))
		if err != nil {
			if !settle.IsPermanent(err) || !errors.Is(err, poison.ErrDecode) {
				t.Fatalf("decode error %v is not permanent or does not wrap poison.ErrDecode", err)
			}
			return
		}
		again, err := json.Marshal(m.Body)
		if err != nil {
			t.Fatal(err)
		}
		back, err := pipeline.Decode[order](nil, message.NewMessage("m", again))
		if err != nil || !reflect.DeepEqual(back.Body, m.Body) {
			t.Fatalf("round trip of %q: %+v, %v; want %+v", payload, back.Body, err, m.Body)
		}
	})
}
