package kvhost_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// reLink is a markdown link or image's target: "](TARGET)" or
// "](TARGET "title")".
var reLink = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)

// reFence is a fenced code block, whose text is no markdown.
var reFence = regexp.MustCompile("(?ms)^ {0,3}```.*?^ {0,3}```")

// TestRelativeLinksInREADMEAndDocsResolve: every relative link of
// README.md and docs/*.md names a file or directory that exists, so that a
// file moved or deleted fails here rather than in a reader's browser. A
// link's #fragment is not checked; links with a scheme (https:, mailto:)
// and links within the page (#...) are left alone.
func TestRelativeLinksInREADMEAndDocsResolve(t *testing.T) {
	docs, err := filepath.Glob(filepath.Join("docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, doc := range append([]string{"README.md"}, docs...) {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		text := reFence.ReplaceAllStringFunc(string(b), func(s string) string {
			return strings.Repeat("\n", strings.Count(s, "\n")) // keep line numbers
		})
		for _, m := range reLink.FindAllStringSubmatchIndex(text, -1) {
			target := text[m[2]:m[3]]
			if strings.HasPrefix(target, "#") || strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			target, _, _ = strings.Cut(target, "#")
			path := filepath.Join(filepath.Dir(doc), filepath.FromSlash(target))
			if _, err := os.Stat(path); err != nil {
				line := strings.Count(text[:m[0]], "\n") + 1
				t.Errorf("%s:%d: link to %s: no such file (%s)", doc, line, target, path)
			}
		}
	}
}
