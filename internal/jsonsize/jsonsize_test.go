package jsonsize_test

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/settle-go/settle/internal/jsonsize"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestIndentedSizeBoundsIndent checks the bound against what json.Indent
// writes, on documents where strings hold the characters the count steps
// over (brackets, commas, colons, escaped quotes) and on deep nesting.
func TestIndentedSizeBoundsIndent(t *testing.T) {
	t.Parallel()
	docs := []string{
		`0`,
		`""`,
		`[]`,
		`{}`,
		`{"a":1,"b":[1,2,{"c":null}]}`,
		`["[{,:}]","\"[,]\"","\\",{"k\":":"v,"}]`,
		`{"deep":` + strings.Repeat("[", 200) + `0,0,0` + strings.Repeat("]", 200) + `}`,
		strings.Repeat("[", 2000) + strings.Repeat("0,", 1000) + "0" + strings.Repeat("]", 2000),
		`[{"x":"<script>\u2028</script>","y":{"z":[true,false]}}]`,
	}
	for _, doc := range docs {
		p := []byte(doc)
		if !json.Valid(p) {
			t.Fatalf("not valid JSON: %.40q", doc)
		}
		var b bytes.Buffer
		if err := json.Indent(&b, p, "", "  "); err != nil {
			t.Fatalf("Indent(%.40q): %v", doc, err)
		}
		if got := jsonsize.IndentedSize(p); got < b.Len() {
			t.Errorf("IndentedSize(%.40q) = %d, below the %d bytes json.Indent writes", doc, got, b.Len())
		}
	}
}

// TestIndentedSizeGrowsWithDepth checks that nesting, not length, is what
// the bound follows: the same number of bytes nested deeper costs more.
func TestIndentedSizeGrowsWithDepth(t *testing.T) {
	t.Parallel()
	flat := []byte("[" + strings.Repeat("0,", 999) + "0]")
	deep := []byte(strings.Repeat("[", 500) + strings.Repeat("0,", 499) + "0" + strings.Repeat("]", 500))
	if f, d := jsonsize.IndentedSize(flat), jsonsize.IndentedSize(deep); d < 100*f {
		t.Errorf("IndentedSize: flat %d bytes, deep %d: deep nesting should cost far more", f, d)
	}
}
