// Command perfsummary regenerates the performance summary of
// docs/performance.md and the README's headline from the raw files in
// docs/bench, as docs/bench/summary.toml selects them:
//
//	go run ./internal/perfsummary          # rewrite both documents
//	go run ./internal/perfsummary -check   # exit 1 where they differ
//
// `make perf-summary` runs the first. It is a tool of this repository,
// not of the kvhost command: it reads the repository's own raw files.
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
)

// errStale is what -check returns where a document differs from what the
// raw files give.
var errStale = errors.New("run make perf-summary")

func main() {
	root := flag.String("root", ".", "the repository's root")
	check := flag.Bool("check", false, "write nothing; fail where a document differs from its regeneration")
	flag.Parse()
	if err := run(*root, *check); err != nil {
		fmt.Fprintln(os.Stderr, "perfsummary:", err)
		os.Exit(1)
	}
}

// The documents, relative to the repository's root.
const (
	manifestPath    = "docs/bench/summary.toml"
	performancePath = "docs/performance.md"
	readmePath      = "README.md"
)

func run(root string, check bool) error {
	docs, err := Generate(root)
	if err != nil {
		return err
	}
	for _, d := range docs {
		if d.Old == d.New {
			continue
		}
		if check {
			return fmt.Errorf("%s differs from what the raw files give: %w", d.Path, errStale)
		}
		if err := os.WriteFile(filepath.Join(root, d.Path), []byte(d.New), 0o644); err != nil {
			return err
		}
		fmt.Println("wrote", d.Path)
	}
	return nil
}

// A Doc is one document as it is (Old) and as the raw files give it (New).
type Doc struct {
	Path     string
	Old, New string
}

// Generate regenerates both documents in memory.
func Generate(root string) ([]Doc, error) {
	mb, err := os.ReadFile(filepath.Join(root, manifestPath))
	if err != nil {
		return nil, err
	}
	m, err := ParseManifest(string(mb))
	if err != nil {
		return nil, err
	}
	results, err := Compute(m, os.DirFS(filepath.Join(root, "docs/bench")))
	if err != nil {
		return nil, err
	}
	var docs []Doc
	for _, d := range []struct {
		path, begin, end, block string
	}{
		{performancePath, perfBegin, perfEnd, PerformanceBlock(m, results)},
		{readmePath, readmeBegin, readmeEnd, ReadmeBlock(m, results)},
	} {
		old, err := os.ReadFile(filepath.Join(root, d.path))
		if err != nil {
			return nil, err
		}
		doc, err := Replace(string(old), d.begin, d.end, d.block)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", d.path, err)
		}
		docs = append(docs, Doc{Path: d.path, Old: string(old), New: doc})
	}
	return docs, nil
}
