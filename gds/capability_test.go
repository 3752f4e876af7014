package gds

import (
	"errors"
	"fmt"
	"testing"

	"golang.org/x/sys/unix"
)

func TestOnlyCuFilesAnswerSettlesAMountsCapability(t *testing.T) {
	cases := []struct {
		name string
		err  error
		want bool
	}{
		{"registered", nil, true},
		{"cuFile refused", fmt.Errorf("gds: cuFileHandleRegister: %w", statusIONotSupported), true},
		{"out of descriptors", fmt.Errorf("gds: dup fd 7: %w", unix.EMFILE), false},
		{"the file changed under the check", errors.New("gds: fd 7 is no longer the keyed file"), false},
		{"cuFile out of descriptors", fmt.Errorf("gds: cuFileHandleRegister: %w", statusGetNewFDFailed), false},
		{"cuFile out of memory", fmt.Errorf("gds: cuFileHandleRegister: %w", statusNoMemory), false},
		{"cuFile internal error", fmt.Errorf("gds: cuFileHandleRegister: %w", statusInternalError), false},
	}
	for _, c := range cases {
		if got := settles(c.err); got != c.want {
			t.Errorf("%s: settles(%v) = %v, want %v", c.name, c.err, got, c.want)
		}
	}
}
