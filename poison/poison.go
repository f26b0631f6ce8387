package poison

import (
	"errors"
	"fmt"
)

// ErrDecode is wrapped by every *DecodeError.
var ErrDecode = errors.New("poison: payload cannot be decoded")

// PermanentError marks an error that no retry can fix. Create it with
// Permanent.
type PermanentError struct {
	Err error
}

// Permanent marks err as permanent: the message is sent to the poison topic
// on its first failure and never retried. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the marked error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent reports true.
func (e *PermanentError) Permanent() bool { return true }

// DecodeError reports a payload that a codec could not decode. It is
// permanent: the same bytes fail the same way every time.
type DecodeError struct {
	// Type names what the payload was decoded into, for the reason text.
	Type string
	Err  error
}

// Decode returns a *DecodeError for a failure to decode into typ.
// Decode(typ, nil) is nil.
func Decode(typ string, err error) error {
	if err == nil {
		return nil
	}
	return &DecodeError{Type: typ, Err: err}
}

func (e *DecodeError) Error() string {
	return fmt.Sprintf("%v into %s: %v", ErrDecode, e.Type, e.Err)
}

// Unwrap returns ErrDecode and the codec's error.
func (e *DecodeError) Unwrap() []error { return []error{ErrDecode, e.Err} }

// Permanent reports true.
func (e *DecodeError) Permanent() bool { return true }
