// Command perfsummary regenerates the performance summaries of
// docs/performance.md and the README's headline from the raw files in
// docs/bench, as docs/bench/summary-*.toml select them:
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
	performancePath = "docs/performance.md"
	readmePath      = "README.md"
)

// A summary is one machine's table: the manifest that selects its raw
// files, and the name of its markers in docs/performance.md
// (summaryMarkers). The README's headline shows each summary's first
// readme_rows rows, in this order.
type summary struct {
	manifest string // relative to the repository's root
	name     string // its markers' name: "perf-summary:NAME:..."
}

// summaries returns the tables, the machine lent now first.
func summaries() []summary {
	return []summary{
		{manifest: "docs/bench/summary-h200.toml", name: "h200"},
		{manifest: "docs/bench/summary-h100.toml", name: "h100"},
	}
}

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

// Generate regenerates both documents in memory: every summary's table
// and the README's headline.
func Generate(root string) ([]Doc, error) {
	docs := []Doc{{Path: performancePath}, {Path: readmePath}}
	for i := range docs {
		b, err := os.ReadFile(filepath.Join(root, docs[i].Path))
		if err != nil {
			return nil, err
		}
		docs[i].Old, docs[i].New = string(b), string(b)
	}
	var parts []headline
	for _, s := range summaries() {
		mb, err := os.ReadFile(filepath.Join(root, s.manifest))
		if err != nil {
			return nil, err
		}
		m, err := ParseManifest(string(mb))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.manifest, err)
		}
		results, err := Compute(m, os.DirFS(filepath.Join(root, "docs/bench")))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", s.manifest, err)
		}
		if err := docs[0].replace(summaryMarkers(s), PerformanceBlock(m, results)); err != nil {
			return nil, err
		}
		if m.ReadmeRows > 0 {
			parts = append(parts, headline{m, results[:m.ReadmeRows]})
		}
	}
	if err := docs[1].replace(readmeMarkers, HeadlineBlock(parts)); err != nil {
		return nil, err
	}
	return docs, nil
}

// replace puts block between the markers of d's new text.
func (d *Doc) replace(mk markers, block string) error {
	doc, err := Replace(d.New, mk.begin, mk.end, block)
	if err != nil {
		return fmt.Errorf("%s: %w", d.Path, err)
	}
	d.New = doc
	return nil
}
