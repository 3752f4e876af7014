package s3local_test

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/kvhost/kvhost/internal/s3local"
)

// BenchmarkParallelRangedGet reads 8 objects of 8 MiB from an s3local
// endpoint on loopback by ranged GETs, 32 in flight (objstore's
// DefaultRequests), and, in the same iterations, the same ranges of the
// same files with pread, 32 at once: the ceiling, what the endpoint reads
// from. It reports both rates and endpoint/ceiling, and the rate of
// loopback-GB/s: net/http's server writing the ranges from memory to
// net/http's client, what HTTP over loopback allows at best. client=sdk is
// aws-sdk-go-v2's client signing every request, as objstore's loads make
// them (the endpoint checks the signatures); client=http is net/http's
// client against an endpoint without keys: the endpoint's cost with less
// of the client's. The directory is $TMPDIR's (a tmpfs on the GPU
// machines: TMPDIR=/dev/shm).
func BenchmarkParallelRangedGet(b *testing.B) {
	const (
		objects  = 8
		size     = 8 << 20
		inflight = 32
	)
	for _, client := range []string{"sdk", "http"} {
		for _, rangeSize := range []int64{1 << 20, 4 << 20} {
			b.Run(fmt.Sprintf("client=%s/range=%dMiB", client, rangeSize>>20), func(b *testing.B) {
				ep := startEndpoint(b, 0)
				if client == "http" {
					ep = startServer(b, s3local.Config{})
				}
				c := newClient(ep.url, testAccess, testSecret, func(o *s3.Options) {
					o.HTTPClient = awshttp.NewBuildableClient().WithTransportOptions(func(t *http.Transport) {
						t.MaxIdleConns, t.MaxIdleConnsPerHost = 2*inflight, 2*inflight
					})
				})
				hc := &http.Client{Transport: &http.Transport{MaxIdleConns: 2 * inflight, MaxIdleConnsPerHost: 2 * inflight}}
				r := rand.New(rand.NewPCG(1, 2))
				obj := make([]byte, size)
				names := make([]string, objects)
				for i := range names {
					for j := range obj {
						obj[j] = byte(r.Uint32())
					}
					names[i] = fmt.Sprintf("kv/0123456789abcdef/%04x", i)
					put(b, ep.client(), names[i], obj)
				}
				buf := make([]byte, objects*size)
				type rng struct {
					obj      int
					off, end int64
				}
				var ranges []rng
				for i := range names {
					for off := int64(0); off < size; off += rangeSize {
						ranges = append(ranges, rng{i, off, min(off+rangeSize, size)})
					}
				}
				// parallel runs read(i, range) for every range, inflight at once.
				parallel := func(read func(r rng, into []byte) error) {
					sem := make(chan struct{}, inflight)
					var wg sync.WaitGroup
					var once sync.Once
					for _, x := range ranges {
						sem <- struct{}{}
						wg.Add(1)
						go func() {
							defer func() { <-sem; wg.Done() }()
							if err := read(x, buf[int64(x.obj)*size+x.off:int64(x.obj)*size+x.end]); err != nil {
								once.Do(func() { b.Error(err) })
							}
						}()
					}
					wg.Wait()
				}
				files := make([]*os.File, objects)
				for i, name := range names {
					f, err := os.Open(ep.objectFile(name))
					if err != nil {
						b.Fatal(err)
					}
					defer f.Close()
					files[i] = f
				}
				get := func(x rng, into []byte) error {
					hdr := fmt.Sprintf("bytes=%d-%d", x.off, x.end-1)
					var body io.ReadCloser
					if client == "sdk" {
						out, err := c.GetObject(context.Background(), &s3.GetObjectInput{Bucket: aws.String(testBucket), Key: &names[x.obj], Range: &hdr})
						if err != nil {
							return err
						}
						body = out.Body
					} else {
						req, _ := http.NewRequest(http.MethodGet, ep.url+"/"+testBucket+"/"+names[x.obj], nil)
						req.Header.Set("Range", hdr)
						resp, err := hc.Do(req)
						if err != nil {
							return err
						}
						if resp.StatusCode != http.StatusPartialContent {
							resp.Body.Close()
							return fmt.Errorf("GET %s: %s", hdr, resp.Status)
						}
						body = resp.Body
					}
					defer body.Close()
					_, err := io.ReadFull(body, into)
					return err
				}
				pread := func(x rng, into []byte) error {
					_, err := files[x.obj].ReadAt(into, x.off)
					return err
				}
				// The loopback's own bound: an HTTP server that writes the
				// ranges from memory, read by the same client as get.
				mem := make([]byte, size)
				copy(mem, buf)
				ms := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					var off, end int64
					fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &off, &end)
					w.Header().Set("Content-Length", fmt.Sprint(end-off+1))
					w.WriteHeader(http.StatusPartialContent)
					w.Write(mem[off : end+1])
				}))
				defer ms.Close()
				loop := func(x rng, into []byte) error {
					req, _ := http.NewRequest(http.MethodGet, ms.URL+"/"+names[x.obj], nil)
					req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", x.off, x.end-1))
					resp, err := hc.Do(req)
					if err != nil {
						return err
					}
					defer resp.Body.Close()
					_, err = io.ReadFull(resp.Body, into)
					return err
				}
				var endpoint, ceiling, loopback time.Duration
				for b.Loop() {
					t0 := time.Now()
					parallel(pread)
					t1 := time.Now()
					parallel(get)
					t2 := time.Now()
					parallel(loop)
					loopback += time.Since(t2)
					endpoint += t2.Sub(t1)
					ceiling += t1.Sub(t0)
				}
				bytes := float64(b.N) * objects * size
				b.ReportMetric(bytes/endpoint.Seconds()/1e9, "endpoint-GB/s")
				b.ReportMetric(bytes/ceiling.Seconds()/1e9, "ceiling-GB/s")
				b.ReportMetric(ceiling.Seconds()/endpoint.Seconds(), "endpoint/ceiling")
				b.ReportMetric(bytes/loopback.Seconds()/1e9, "loopback-GB/s")
			})
		}
	}
}
