package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/kvhost/kvhost/protocol"
)

// TestPurgeRemovesAModelsFilesByModelOrFingerprint: `kvhost purge --model`
// removes the files of the namespaces declared with that model id, and
// says what it removed (again: nothing, no error); --fingerprint removes
// one namespace's; a model or fingerprint the daemon does not know, no
// selector, both, or a fingerprint that is not 16 hex digits are refused,
// naming what was wrong.
func TestPurgeRemovesAModelsFilesByModelOrFingerprint(t *testing.T) {
	ctx, socket := serveTestConfig(t)
	k := newKVCache(t, socket)
	store := func(keys ...string) {
		t.Helper()
		for i, key := range keys {
			res, err := k.do(ctx, true, key, []uint32{uint32(2 * i), uint32(2*i + 1)})
			if err != nil || res.Count(protocol.OutcomeStored) != 1 {
				t.Fatalf("store %s: %+v, %v", key, res, err)
			}
		}
	}
	purge := func(args ...string) (int, string, string) {
		var out, errb bytes.Buffer
		code := run(ctx, append([]string{"purge", "--socket", socket}, args...), &out, &errb)
		return code, out.String(), errb.String()
	}

	store("a", "b", "c")
	code, out, errs := purge("--model", opsGeo.Model)
	if code != 0 || !strings.Contains(out, `purged model "`+opsGeo.Model+`" (1 namespace): 3 files, 3 keys`) {
		t.Fatalf("kvhost purge --model: exit %d, %q %q; want the model's 3 keys purged", code, out, errs)
	}
	if st := statsJSON(t, ctx, socket); st.Keys != 0 {
		t.Fatalf("%d keys stored after the purge, want 0", st.Keys)
	}

	store("d", "e")
	st := statsJSON(t, ctx, socket)
	if len(st.Namespaces) != 1 {
		t.Fatalf("namespaces %+v, want the one declared", st.Namespaces)
	}
	code, out, errs = purge("--fingerprint", st.Namespaces[0].Fingerprint)
	if code != 0 || !strings.Contains(out, "purged namespace "+st.Namespaces[0].Fingerprint+": 2 files, 2 keys") {
		t.Fatalf("kvhost purge --fingerprint: exit %d, %q %q; want its 2 keys purged", code, out, errs)
	}
	if st := statsJSON(t, ctx, socket); st.Keys != 0 {
		t.Fatalf("%d keys stored after the purge by fingerprint, want 0", st.Keys)
	}
	// Purging a model again is no error: nothing is left to remove.
	if code, out, errs := purge("--model", opsGeo.Model); code != 0 || !strings.Contains(out, "0 files, 0 keys") {
		t.Fatalf("kvhost purge --model again: exit %d, %q %q; want nothing removed, exit 0", code, out, errs)
	}

	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--model", "no/such-model"}, 1, `no namespace of model "no/such-model" was declared since the daemon started`},
		{[]string{"--fingerprint", "00000000000000ff"}, 1, "no namespace of fingerprint 00000000000000ff"},
		{[]string{"--fingerprint", "123"}, 2, `--fingerprint "123": want 16 hex digits`},
		{nil, 2, "give exactly one of --model and --fingerprint"},
		{[]string{"--model", "m", "--fingerprint", "1"}, 2, "give exactly one of --model and --fingerprint"},
		{[]string{"--fingerprint", "xyz"}, 2, `--fingerprint "xyz": want 16 hex digits`},
	} {
		code, out, errs := purge(tc.args...)
		if code != tc.code || !strings.Contains(errs, tc.want) {
			t.Errorf("kvhost purge %v: exit %d, %q %q; want %d and %q", tc.args, code, out, errs, tc.code, tc.want)
		}
	}
}
