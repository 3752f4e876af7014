package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/protocol"
)

// runPurge implements `kvhost purge`: every file of one model's
// namespaces, or of one namespace fingerprint, is removed from the
// daemon's mounts.
func runPurge(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost purge", "usage: kvhost purge [--socket PATH | --config FILE] (--model ID | --fingerprint HEX) [--timeout D]\n\n"+
		"Removes every file of a model's namespaces (--model: the model id kvhost stats lists; every namespace declared\n"+
		"with it since the daemon started) or of one namespace (--fingerprint: 16 hex digits, as kvhost stats lists it;\n"+
		"also files found on the mounts that no client declared since the start) from the daemon's mounts. Files a\n"+
		"client pins stay. Stop the model's instances first: a store still running may leave files behind. Exits 1\n"+
		"where the daemon knows no such model or fingerprint, or could not remove a file (a later purge tries it again).", stderr)
	df := bindDaemonFlags(fs, time.Minute, "give up after this long")
	model := fs.String("model", "", "the model `id` whose namespaces go (as kvhost stats lists it)")
	fpHex := fs.String("fingerprint", "", "the namespace `fingerprint` whose files go (16 hex digits, as kvhost stats lists it)")
	if code, ok := df.parse(fs, args, stdout, stderr); !ok {
		return code
	}
	if (*model == "") == (*fpHex == "") {
		fmt.Fprintln(stderr, "kvhost purge: give exactly one of --model and --fingerprint")
		return 2
	}
	var fp uint64
	if *fpHex != "" {
		v, err := strconv.ParseUint(*fpHex, 16, 64)
		if err != nil || len(*fpHex) != 16 {
			fmt.Fprintf(stderr, "kvhost purge: --fingerprint %q: want 16 hex digits, as kvhost stats lists them\n", *fpHex)
			return 2
		}
		fp = v
	}
	ctx, cancel := df.withTimeout(ctx)
	defer cancel()
	if err := purge(ctx, *df.socket, *model, fp, stdout); err != nil {
		fmt.Fprintf(stderr, "kvhost purge: %s: %v\n", *df.socket, df.explain(err))
		return 1
	}
	return 0
}

// purge removes the files of model's namespaces, or where model is
// empty, of the namespace of fingerprint fp.
func purge(ctx context.Context, socket, model string, fp uint64, stdout io.Writer) error {
	c, err := dialDaemon(ctx, socket, "kvhost purge")
	if err != nil {
		return err
	}
	defer c.Close()
	var r client.Purged
	if model != "" {
		r, err = c.PurgeModel(ctx, model)
	} else {
		r, err = c.Purge(ctx, fp)
	}
	if errors.Is(err, &protocol.Error{Code: protocol.CodeUnknownType}) {
		return errors.New("the daemon predates kvhost purge")
	}
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, purgedText(model, fp, r))
	if r.Left > 0 {
		return fmt.Errorf("%s could not be removed (the daemon's log says why): no longer served, but still on disk until a later purge or an eviction removes them; fix the cause and purge again", plural(r.Left, "file"))
	}
	return nil
}

// purgedText says what a purge removed.
func purgedText(model string, fp uint64, r client.Purged) string {
	what := fmt.Sprintf("namespace %016x", fp)
	if model != "" {
		what = fmt.Sprintf("model %q (%s)", model, plural(r.Namespaces, "namespace"))
	}
	s := fmt.Sprintf("purged %s: %s, %s, %s", what, plural(r.Files, "file"), plural(r.Keys, "key"), bytesString(r.Bytes))
	if r.Pinned > 0 {
		s += fmt.Sprintf("; %s kept: a client pins them", plural(r.Pinned, "file"))
	}
	return s
}

// plural writes n and noun, with an s where n is not 1.
func plural(n uint64, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}
