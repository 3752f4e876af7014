// Command s3local serves a minimal S3 endpoint over a local directory,
// for tests and benchmarks where no object store can run (package
// internal/s3local; docs/object.md, "Without an object store: s3local").
// It is not for production.
//
//	s3local --dir DIR [--addr 127.0.0.1:PORT] [--access-key K --secret-key S]
//	        [--quota BYTES] [--bucket NAME]
//
// It prints the URL it listens on, one line on standard output, and
// serves until SIGTERM or SIGINT. --bucket makes a bucket at start where
// it is missing; --quota bounds the bytes of every object (QuotaExceeded
// past it). The keys default to
// $KVHOST_S3_ACCESS_KEY and $KVHOST_S3_SECRET_KEY, as the daemon's; with
// neither it serves every request, signed or not.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/kvhost/kvhost/internal/s3local"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout); err != nil {
		stop()
		fmt.Fprintln(os.Stderr, "s3local:", err)
		os.Exit(1)
	}
}

// run serves as args ask until ctx ends, printing the URL to out once it
// listens.
func run(ctx context.Context, args []string, out io.Writer) error {
	fl := flag.NewFlagSet("s3local", flag.ContinueOnError)
	dir := fl.String("dir", "", "the directory of the buckets, one subdirectory each (required)")
	addr := fl.String("addr", "127.0.0.1:9000", "the address to listen on (port 0: any free port)")
	access := fl.String("access-key", os.Getenv("KVHOST_S3_ACCESS_KEY"), "the access key requests must be signed with")
	secret := fl.String("secret-key", os.Getenv("KVHOST_S3_SECRET_KEY"), "its secret key")
	quota := fl.Int64("quota", 0, "the most bytes of objects under the directory (0: no bound)")
	bucket := fl.String("bucket", "", "a bucket to create at start where it is missing")
	if err := fl.Parse(args); err != nil {
		return err
	}
	if *dir == "" || fl.NArg() > 0 {
		fl.Usage()
		return errors.New("usage: s3local --dir DIR [--addr HOST:PORT] [--access-key K --secret-key S] [--quota BYTES] [--bucket NAME]")
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	srv, err := s3local.New(s3local.Config{Dir: *dir, AccessKey: *access, SecretKey: *secret, Quota: *quota, Logger: log})
	if err != nil {
		return err
	}
	if *bucket != "" {
		if err := srv.CreateBucket(*bucket); err != nil {
			return err
		}
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "http://%s\n", ln.Addr())
	if *access == "" {
		log.Warn("s3local: no keys: every request is served, signed or not")
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: time.Minute, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(ln) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return hs.Shutdown(sctx)
}
