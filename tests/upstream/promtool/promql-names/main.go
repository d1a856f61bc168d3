// promql-names reads a JSON array of PromQL expressions on stdin and writes, for each, the metric names
// its selectors name, or why it does not parse: a JSON array of {"names": [...], "error": "..."}.
// tests/monitoring.rs checks with it that deploy/monitoring/ names only metrics the provider exports. It
// uses the PromQL parser of the Prometheus release promtool is built from (go.mod here).
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type result struct {
	Names []string `json:"names"`
	Error string   `json:"error,omitempty"`
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintf(os.Stderr, "promql-names: reading a JSON array of strings: %v\n", err)
		os.Exit(2)
	}
	p := parser.NewParser(parser.Options{})
	out := make([]result, 0, len(exprs))
	for _, e := range exprs {
		expr, err := p.ParseExpr(e)
		if err != nil {
			out = append(out, result{Names: []string{}, Error: err.Error()})
			continue
		}
		seen := map[string]bool{}
		parser.Inspect(expr, func(node parser.Node, _ []parser.Node) error {
			if vs, ok := node.(*parser.VectorSelector); ok {
				name := vs.Name
				for _, m := range vs.LabelMatchers {
					if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
						name = m.Value
					}
				}
				seen[name] = true
			}
			return nil
		})
		names := make([]string, 0, len(seen))
		for n := range seen {
			names = append(names, n)
		}
		sort.Strings(names)
		out = append(out, result{Names: names})
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintf(os.Stderr, "promql-names: %v\n", err)
		os.Exit(1)
	}
}
