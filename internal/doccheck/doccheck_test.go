package doccheck_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var goBlock = regexp.MustCompile("(?ms)^```go\n(.*?)^```")

// Every Go snippet of the guide is a whole file (package clause, imports,
// code) that type-checks and passes vet as shown: each is written into a
// package of its own inside this module and vetted with the module's
// dependencies.
func TestGettingStartedSnippetsCompile(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/getting-started.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := goBlock.FindAllStringSubmatch(string(doc), -1)
	if len(blocks) < 8 {
		t.Fatalf("found %d Go snippets in getting-started.md; the guide has more", len(blocks))
	}
	if err := os.MkdirAll("testdata", 0o755); err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("testdata", "snippets-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	var pkgs []string
	for i, b := range blocks {
		src := b[1]
		if !strings.HasPrefix(src, "package ") {
			t.Errorf("snippet %d does not start with a package clause, so it does not compile as shown:\n%s", i+1, src)
			continue
		}
		pdir := filepath.Join(dir, fmt.Sprintf("s%02d", i+1))
		if err := os.MkdirAll(pdir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(pdir, "snippet.go"), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		pkgs = append(pkgs, "./"+filepath.ToSlash(pdir))
	}
	cmd := exec.Command("go", append([]string{"vet"}, pkgs...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go vet of the snippets (s01 is the first ```go block of docs/getting-started.md): %v\n%s", err, out)
	}
}
