package reliability

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/internal/testsock"
)

// TestLoadRepeatedKey loads one stored key into two destinations in one
// load job (the torture's random samples did this): both destinations get
// its bytes, and the daemon counts no failure.
func TestLoadRepeatedKey(t *testing.T) {
	base := testsock.Dir(t)
	d := startDaemon(t, daemonConfig{Socket: filepath.Join(base, "kvhost.sock"), Mount: filepath.Join(base, "cache")})
	ctx := context.Background()
	c, k, err := dialCache(ctx, d.cfg.Socket, "repeat", 8)
	if err != nil {
		t.Fatal(err)
	}
	defer k.close()
	defer c.Close()
	key := []byte("repeated")
	if res, err := k.store(ctx, [][]byte{key}); err != nil || res.Count(client.OutcomeStored) != 1 {
		t.Fatalf("store: %v %v", res.Keys, err)
	}
	before, err := c.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	r, err := k.load(ctx, [][]byte{key, key})
	if err != nil {
		t.Fatal(err)
	}
	for i, ok := range r.match {
		if !ok {
			t.Errorf("destination %d of the repeated key: %v code %d (%s)", i, r.outcomes[i], r.codes[i], r.message)
		}
	}
	after, err := c.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if after.Failures != before.Failures {
		t.Errorf("the daemon counted %d failures for a load that should not fail", after.Failures-before.Failures)
	}
}
