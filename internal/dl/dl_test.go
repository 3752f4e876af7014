//go:build linux && cgo

package dl

import (
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// buildLib compiles testdata/answer.c into a shared library in a temp dir.
func buildLib(t *testing.T) string {
	t.Helper()
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skipf("no C compiler (cc) to build the test library: %v", err)
	}
	out := filepath.Join(t.TempDir(), "libanswer.so")
	if b, err := exec.Command(cc, "-shared", "-fPIC", "-o", out, "testdata/answer.c").CombinedOutput(); err != nil {
		t.Fatalf("build test library: %v\n%s", err, b)
	}
	return out
}

func TestOpenResolvesSymbolOfFirstLoadablePath(t *testing.T) {
	lib := buildLib(t)
	l, err := Open("/nonexistent/libnothing.so", lib)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	defer l.Close()
	if l.Path() != lib {
		t.Errorf("Path = %q, want %q", l.Path(), lib)
	}
	if p, err := l.Sym("kvhost_dl_answer"); err != nil || p == nil {
		t.Fatalf("Sym: %v, %v", p, err)
	}
	_, err = l.Sym("kvhost_no_such_symbol")
	if !errors.Is(err, ErrSymbol) {
		t.Fatalf("Sym of a missing symbol: %v, want ErrSymbol", err)
	}
}

func TestOpenKeepsDlerrorTextOfEveryPath(t *testing.T) {
	_, err := Open("/nonexistent/liba.so", "/nonexistent/libb.so")
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v, want ErrUnavailable", err)
	}
	for _, want := range []string{"liba.so", "libb.so"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
}
