package poison_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/settle-go/settle"
	"github.com/settle-go/settle/dedupe"
	"github.com/settle-go/settle/poison"
)

type selfMarked struct{ permanent bool }

func (e selfMarked) Error() string   { return "self-marked" }
func (e selfMarked) Permanent() bool { return e.permanent }

func TestIsPermanent(t *testing.T) {
	t.Parallel()
	var syntax *json.SyntaxError
	decodeErr := poison.Decode("Order", json.Unmarshal([]byte("{"), &struct{}{}))
	cases := []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"plain", errors.New("timeout"), false},
		{"marked", poison.Permanent(errors.New("bad currency")), true},
		{"wrapped marked", fmt.Errorf("charge: %w", poison.Permanent(errors.New("x"))), true},
		{"joined with a marked one", errors.Join(errors.New("a"), poison.Permanent(errors.New("b"))), true},
		{"decode", decodeErr, true},
		{"dedupe key error", &dedupe.KeyError{Err: dedupe.ErrEmptyKey}, true},
		{"self-marked true", selfMarked{true}, true},
		{"self-marked false", selfMarked{false}, false},
		{"busy is not permanent", dedupe.ErrBusy, false},
	}
	for _, c := range cases {
		if got := settle.IsPermanent(c.err); got != c.want {
			t.Errorf("%s: IsPermanent(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
	if !errors.Is(decodeErr, poison.ErrDecode) || !errors.As(decodeErr, &syntax) {
		t.Errorf("decode error %v does not wrap ErrDecode and the codec's error", decodeErr)
	}
	if poison.Permanent(nil) != nil || poison.Decode("T", nil) != nil {
		t.Error("marking nil must give nil")
	}
}
