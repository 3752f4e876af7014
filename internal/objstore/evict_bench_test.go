package objstore

import (
	"fmt"
	"testing"
)

// BenchmarkEviction measures what choosing the victims of an eviction
// costs the store, with its lock held (the lookups wait meanwhile), among
// 10k and 1M objects of 1 MiB: "one" evicts a single object per upload
// (a quota's refusal evicts the object's size), "to-0.9" fills the bound
// and evicts down to 0.9 of it as takeRoom does, and reports the cost
// per evicted object; "forget-0.1" is its ceiling: forgetting as many
// objects, named in advance, which every eviction does besides choosing.
// No request is sent.
func BenchmarkEviction(b *testing.B) {
	const size = 1 << 20
	for _, n := range []int{10_000, 1_000_000} {
		fill := func(b *testing.B) (*Store, func() string) {
			s := newStore(Config{Requests: 1}, nil)
			next := 0
			name := func() string { next++; return fmt.Sprintf("kv/%016x/%08x", 1, next) }
			for range n {
				s.add(name(), size)
			}
			return s, name
		}
		b.Run(fmt.Sprintf("one/objects=%d", n), func(b *testing.B) {
			s, name := fill(b)
			for b.Loop() {
				v := s.victims(1)
				if len(v) != 1 {
					b.Fatalf("%d victims, want 1", len(v))
				}
				delete(s.deleting, v[0])
				s.add(name(), size)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N), "ns/evicted")
		})
		b.Run(fmt.Sprintf("to-0.9/objects=%d", n), func(b *testing.B) {
			s, name := fill(b)
			evicted := 0
			for b.Loop() {
				v := s.victims(int64(n) * size / 10)
				if len(v) != n/10 {
					b.Fatalf("%d victims, want %d", len(v), n/10)
				}
				evicted += len(v)
				b.StopTimer()
				for range v {
					s.add(name(), size)
				}
				clear(s.deleting)
				b.StartTimer()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(evicted), "ns/evicted")
		})
		b.Run(fmt.Sprintf("forget-0.1/objects=%d", n), func(b *testing.B) {
			s, name := fill(b)
			evicted := 0
			for b.Loop() {
				b.StopTimer()
				v := make([]string, 0, n/10)
				for range n / 10 {
					v = append(v, name())
					s.add(v[len(v)-1], size)
				}
				b.StartTimer()
				s.mu.Lock()
				for _, name := range v {
					s.forgetLocked(name)
					s.deleting[name] = struct{}{}
				}
				s.mu.Unlock()
				evicted += len(v)
				b.StopTimer()
				clear(s.deleting)
				b.StartTimer()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(evicted), "ns/evicted")
		})
	}
}
