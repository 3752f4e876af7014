package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvhost/kvhost/client"
	"github.com/kvhost/kvhost/protocol"
)

// runPurge implements `kvhost purge`: every file of one model's
// namespaces, or of one namespace fingerprint, is removed from the
// daemon's mounts.
func runPurge(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvhost purge", "usage: kvhost purge [--socket PATH | --config FILE] (--model ID | --fingerprint HEX) [--timeout D]\n\n"+
		"Removes every file of a model's namespaces (--model: the model id kvhost stats lists) or of one namespace\n"+
		"(--fingerprint: 16 hex digits, as kvhost stats lists it, for files found on the mounts that no client declared\n"+
		"since the start) from the daemon's mounts. Files a client pins stay. Stop the model's instances first: a store\n"+
		"still running may leave files behind.", stderr)
	df := bindDaemonFlags(fs, time.Minute, "give up after this long")
	model := fs.String("model", "", "the model `id` whose namespaces go (as kvhost stats lists it)")
	fpHex := fs.String("fingerprint", "", "the namespace `fingerprint` whose files go (16 hex digits, as kvhost stats lists it)")
	if code, ok := df.parse(fs, args, stderr); !ok {
		return code
	}
	if (*model == "") == (*fpHex == "") {
		fmt.Fprintln(stderr, "kvhost purge: give exactly one of --model and --fingerprint")
		return 2
	}
	var fps []uint64
	if *fpHex != "" {
		fp, err := strconv.ParseUint(*fpHex, 16, 64)
		if err != nil {
			fmt.Fprintf(stderr, "kvhost purge: --fingerprint %q: want 16 hex digits, as kvhost stats lists them\n", *fpHex)
			return 2
		}
		fps = []uint64{fp}
	}
	ctx, cancel := df.withTimeout(ctx)
	defer cancel()
	if err := purge(ctx, *df.socket, *model, fps, stdout); err != nil {
		fmt.Fprintf(stderr, "kvhost purge: %s: %v\n", *df.socket, err)
		return 1
	}
	return 0
}

// purge removes the files of namespaces fps, or where model is set, of
// every namespace the daemon lists under that model id.
func purge(ctx context.Context, socket, model string, fps []uint64, stdout io.Writer) error {
	c, err := dialDaemon(ctx, socket, "kvhost purge")
	if err != nil {
		return err
	}
	defer c.Close()
	if model != "" {
		st, err := c.Stats(ctx)
		if err != nil {
			return err
		}
		if st.Namespaces == nil {
			return errors.New("the daemon predates kvhost purge (its stats list no namespaces)")
		}
		var known []string
		for _, ns := range st.Namespaces.List {
			if ns.Model == model {
				fps = append(fps, ns.Fingerprint)
			} else if ns.Model != "" && !slices.Contains(known, ns.Model) {
				known = append(known, ns.Model)
			}
		}
		if len(fps) == 0 {
			more := ""
			if n := st.Namespaces.LeftOut; n > 0 {
				more = fmt.Sprintf(" (and leaves %d namespaces holding less out of its list)", n)
			}
			return fmt.Errorf("no namespace of model %q: the daemon lists %s%s; files found on the mounts that no client declared since the start go by --fingerprint (kvhost stats)",
				model, orNone(known), more)
		}
	}
	for _, fp := range fps {
		r, err := c.Purge(ctx, fp)
		if errors.Is(err, &protocol.Error{Code: protocol.CodeUnknownType}) {
			return errors.New("the daemon predates kvhost purge")
		}
		if err != nil {
			return err
		}
		fmt.Fprintln(stdout, purgedText(model, fp, r))
	}
	return nil
}

// purgedText says what one namespace's purge removed.
func purgedText(model string, fp uint64, r client.Purged) string {
	what := fmt.Sprintf("namespace %016x", fp)
	if model != "" {
		what = fmt.Sprintf("model %s (namespace %016x)", model, fp)
	}
	s := fmt.Sprintf("purged %s: %d files, %d keys, %s", what, r.Files, r.Keys, bytesString(r.Bytes))
	if r.Pinned > 0 {
		s += fmt.Sprintf("; %d files kept: a client pins them", r.Pinned)
	}
	return s
}

// orNone lists names, or says there are none.
func orNone(names []string) string {
	if len(names) == 0 {
		return "no declared model"
	}
	return "the models " + strings.Join(names, ", ")
}
