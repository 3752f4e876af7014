package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestRunServesTheDirectoryAtTheURLItPrintsUntilCancelled: s3local on
// port 0 prints its URL, answers there (the bucket it was asked to make
// exists, another does not), and returns nil once its context ends.
func TestRunServesTheDirectoryAtTheURLItPrintsUntilCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--dir", t.TempDir(), "--addr", "127.0.0.1:0", "--bucket", "kvcache", "--access-key", "", "--secret-key", ""}, pw)
	}()
	url, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil || !strings.HasPrefix(url, "http://127.0.0.1:") {
		t.Fatalf("printed %q (%v), want the URL", url, err)
	}
	url = strings.TrimSpace(url)
	for bucket, want := range map[string]int{"kvcache": http.StatusOK, "other": http.StatusNotFound} {
		req, _ := http.NewRequest(http.MethodHead, url+"/"+bucket, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Fatalf("HEAD of bucket %s: %d, want %d", bucket, resp.StatusCode, want)
		}
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("run after its context ended: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("run did not return within a minute of its context's end")
	}
}

// TestRunRefusesBadArguments: no directory, a stray argument, one key of
// the pair, a bucket name S3 refuses.
func TestRunRefusesBadArguments(t *testing.T) {
	dir := t.TempDir()
	for _, args := range [][]string{
		{},
		{"--dir", dir, "stray"},
		{"--dir", dir, "--access-key", "a", "--secret-key", ""},
		{"--dir", dir, "--bucket", "Not_A_Bucket"},
	} {
		if err := run(context.Background(), args, io.Discard); err == nil {
			t.Errorf("run %q succeeded", args)
		}
	}
}
