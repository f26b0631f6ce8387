package poison

import (
	"errors"
	"fmt"
)

// ErrDecode is wrapped by the errors of Decode.
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

// Decode marks a failure to decode a payload into typ as permanent: the
// same bytes fail the same way every time. The error wraps ErrDecode and
// err. Decode(typ, nil) is nil.
func Decode(typ string, err error) error {
	if err == nil {
		return nil
	}
	return Permanent(fmt.Errorf("%w into %s: %w", ErrDecode, typ, err))
}
