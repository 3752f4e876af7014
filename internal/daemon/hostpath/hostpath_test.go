package hostpath

import (
	"testing"

	"github.com/kvhost/kvhost/internal/engine"
	"github.com/kvhost/kvhost/staging"
)

// TestStagingHasTheSpecsWorkersAndBuffers: the path Staging builds runs
// the spec's buffers, of its size, and names itself as the staging
// pipeline does, for direct and buffered mounts alike.
func TestStagingHasTheSpecsWorkersAndBuffers(t *testing.T) {
	p, err := Staging(engine.HostSpec{Workers: 2, BufferSize: 1 << 20, Buffers: 3})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	inUse, limit, size := p.Buffers()
	if inUse != 0 || limit != 3 || size != 1<<20 {
		t.Fatalf("buffers: %d in use, limit %d, size %d; want 0, 3, %d", inUse, limit, size, 1<<20)
	}
	for _, direct := range []bool{false, true} {
		if got := p.For(direct).Name(); got != "staging" {
			t.Errorf("For(%v).Name() = %q, want staging", direct, got)
		}
	}
}

// TestEngineDefaultWorkersAreStagingsDefault: an engine whose Config sets
// no IOWorkers runs as many as a staging pool would by default.
func TestEngineDefaultWorkersAreStagingsDefault(t *testing.T) {
	if got, want := engine.DefaultIOWorkers(), staging.DefaultWorkers(); got != want {
		t.Fatalf("engine.DefaultIOWorkers() = %d, staging.DefaultWorkers() = %d", got, want)
	}
}
