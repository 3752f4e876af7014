package objstore

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// TestEvictionsTakeTheLeastRecentlyUsedObjectsAsASortWould: after random
// uploads, uses, removals and listings, every eviction's victims are the
// objects a sort of every object by last use, then name, puts first, and
// the bytes known stay the sum of the objects' sizes.
func TestEvictionsTakeTheLeastRecentlyUsedObjectsAsASortWould(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3, 4} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 1))
			s := newStore(Config{Requests: 1}, nil)
			ref := map[string]object{} // what a sort evicts from
			name := func() string { return fmt.Sprintf("kv/%016x/%04x", 1, r.IntN(300)) }
			for step := range 3000 {
				switch op := r.IntN(10); {
				case op < 4: // an upload, or an object listed
					n, o := name(), object{size: 1 + r.Int64N(100), at: r.Int64N(1000)}
					s.mu.Lock()
					s.present.set(n, o)
					s.mu.Unlock()
					ref[n] = o
				case op < 6: // a load
					n := name()
					s.touch(n)
					if o, ok := ref[n]; ok {
						got, _ := s.present.get(n)
						o.at = got.at
						ref[n] = o
					}
				case op < 7:
					n := name()
					s.forget(n)
					delete(ref, n)
				case op < 8: // a listing that found what was known
					s.mu.Lock()
					s.present = newKnown(ref)
					s.mu.Unlock()
				default:
					want := r.Int64N(500)
					got := s.victims(want)
					if exp := sortedVictims(ref, want); !slices.Equal(got, exp) {
						t.Fatalf("step %d: eviction of %d bytes took %v, want %v", step, want, got, exp)
					}
					for _, n := range got {
						delete(ref, n)
						delete(s.deleting, n)
					}
				}
				var used int64
				for _, o := range ref {
					used += o.size
				}
				if u, _, n := s.Usage(); u != used || n != len(ref) {
					t.Fatalf("step %d: %d objects of %d bytes known, want %d of %d", step, n, u, len(ref), used)
				}
			}
		})
	}
}

// sortedVictims is what evictions did before known: a sort of every
// object.
func sortedVictims(objs map[string]object, want int64) []string {
	var names []string
	for n := range objs {
		names = append(names, n)
	}
	slices.SortFunc(names, func(a, b string) int {
		return cmp.Or(cmp.Compare(objs[a].at, objs[b].at), strings.Compare(a, b))
	})
	var out []string
	for _, n := range names {
		if want <= 0 {
			break
		}
		out = append(out, n)
		want -= objs[n].size
	}
	return out
}
