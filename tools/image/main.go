// Command image assembles the provider's OCI image from static binaries without a Docker engine: the
// final stage of the Dockerfile (FROM scratch, LABEL, COPY --from of the binary, USER, EXPOSE,
// ENTRYPOINT, CMD, ENV, WORKDIR) is read and applied to an empty image, one per platform, so the result
// carries the configuration `docker build` would give it. The Dockerfile stays the one source of truth.
//
//	go run . --dockerfile ../../Dockerfile --binary linux/amd64=PATH [--binary linux/arm64=PATH] \
//	    --build-arg VERSION=0.1.0 --build-arg REVISION=<commit> \
//	    --oci-layout DIR [--tarball FILE --tag capi-autoscaler-provider:0.1.0]
//
// Writes an OCI image layout (an image index with one manifest per platform) and, optionally, a
// tarball that `docker load` reads (one platform). Prints digests and sizes.
package main

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// BuildKit gives images built FROM scratch this PATH; kept so both builds have the same config.
const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "image: %v\n", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	dockerfile := fs.String("dockerfile", "Dockerfile", "the Dockerfile whose final stage describes the image")
	var binaries, buildArgs multiFlag
	fs.Var(&binaries, "binary", "OS/ARCH[/VARIANT]=PATH of the static binary for that platform (repeatable)")
	fs.Var(&buildArgs, "build-arg", "NAME=VALUE, as docker build --build-arg (repeatable)")
	created := fs.String("created", "", "creation time (RFC 3339); default $SOURCE_DATE_EPOCH, else the Unix epoch (reproducible)")
	ociLayout := fs.String("oci-layout", "", "directory to write the OCI image layout to (replaced)")
	tarballPath := fs.String("tarball", "", "file to write a `docker load` tarball of one platform to")
	tarballPlatform := fs.String("tarball-platform", "", "platform of the tarball (default: the first --binary)")
	tag := fs.String("tag", "", "image reference for the tarball and the layout's ref.name annotation, e.g. capi-autoscaler-provider:0.1.0")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if len(binaries) == 0 {
		return errors.New("no --binary")
	}
	if *ociLayout == "" && *tarballPath == "" {
		return errors.New("nothing to write: give --oci-layout and/or --tarball")
	}
	argValues := map[string]string{}
	for _, a := range buildArgs {
		k, v, ok := strings.Cut(a, "=")
		if !ok || k == "" {
			return fmt.Errorf("--build-arg %q: want NAME=VALUE", a)
		}
		argValues[k] = v
	}
	when, err := creationTime(*created)
	if err != nil {
		return err
	}
	text, err := os.ReadFile(*dockerfile)
	if err != nil {
		return err
	}
	stage, err := finalStage(string(text), argValues)
	if err != nil {
		return fmt.Errorf("%s: %w", *dockerfile, err)
	}

	var images []platformImage
	seen := map[string]bool{}
	for _, b := range binaries {
		spec, file, ok := strings.Cut(b, "=")
		if !ok {
			return fmt.Errorf("--binary %q: want OS/ARCH=PATH", b)
		}
		platform, err := v1.ParsePlatform(spec)
		if err != nil {
			return fmt.Errorf("--binary %q: %w", b, err)
		}
		if seen[platform.String()] {
			return fmt.Errorf("--binary %q: a second binary for %s", b, platform)
		}
		seen[platform.String()] = true
		if err := checkMachine(file, *platform); err != nil {
			return fmt.Errorf("--binary %q: %w", b, err)
		}
		img, err := buildImage(stage, *platform, file, when)
		if err != nil {
			return fmt.Errorf("%s: %w", spec, err)
		}
		images = append(images, platformImage{platform: *platform, image: img, binary: file})
	}

	if *ociLayout != "" {
		if err := writeLayout(*ociLayout, images, *tag); err != nil {
			return fmt.Errorf("OCI layout %s: %w", *ociLayout, err)
		}
	}
	if *tarballPath != "" {
		if *tag == "" {
			return errors.New("--tarball needs --tag")
		}
		if err := writeTarball(*tarballPath, images, *tarballPlatform, *tag); err != nil {
			return fmt.Errorf("tarball %s: %w", *tarballPath, err)
		}
	}
	return nil
}

func creationTime(flagValue string) (time.Time, error) {
	if flagValue != "" {
		t, err := time.Parse(time.RFC3339, flagValue)
		if err != nil {
			return time.Time{}, fmt.Errorf("--created %q: %w", flagValue, err)
		}
		return t.UTC(), nil
	}
	if epoch := os.Getenv("SOURCE_DATE_EPOCH"); epoch != "" {
		secs, err := strconv.ParseInt(epoch, 10, 64)
		if err != nil {
			return time.Time{}, fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", epoch, err)
		}
		return time.Unix(secs, 0).UTC(), nil
	}
	return time.Unix(0, 0).UTC(), nil
}

// stageConfig is what the final stage of the Dockerfile says about the image.
type stageConfig struct {
	labels      map[string]string
	user        string
	ports       []string
	entrypoint  []string
	cmd         []string
	env         []string
	workdir     string
	binaryDest  string // where COPY --from puts the binary
	history     []v1.History
	copyHistory int // index of the COPY in history
}

type platformImage struct {
	platform v1.Platform
	image    v1.Image
	binary   string
}

// finalStage reads the instructions after the last FROM, which must be `FROM scratch`. Only what an
// image assembled from one binary can honour is accepted; anything else is an error rather than an
// image that silently differs from `docker build`'s.
func finalStage(text string, buildArgs map[string]string) (*stageConfig, error) {
	instructions, err := logicalLines(text)
	if err != nil {
		return nil, err
	}
	globalArgs := map[string]string{}
	last := -1
	for i, in := range instructions {
		if in.keyword == "FROM" {
			last = i
		}
	}
	if last < 0 {
		return nil, errors.New("no FROM")
	}
	// ARGs before the first FROM are global defaults; a stage sees them only when it redeclares them.
	for _, in := range instructions {
		if in.keyword == "FROM" {
			break
		}
		if in.keyword == "ARG" {
			k, v, _ := strings.Cut(in.args, "=")
			globalArgs[strings.TrimSpace(k)] = unquote(strings.TrimSpace(v))
		}
	}
	from := strings.Fields(instructions[last].args)
	if len(from) == 0 || from[0] != "scratch" {
		return nil, fmt.Errorf("line %d: the final stage must be FROM scratch, not %q", instructions[last].line, instructions[last].args)
	}
	cfg := &stageConfig{labels: map[string]string{}, env: []string{defaultPath}, copyHistory: -1}
	vars := map[string]string{}
	for _, in := range instructions[last+1:] {
		fail := func(format string, a ...any) error {
			return fmt.Errorf("line %d (%s): %s", in.line, in.keyword, fmt.Sprintf(format, a...))
		}
		switch in.keyword {
		case "ARG":
			for _, word := range strings.Fields(in.args) {
				k, def, hasDefault := strings.Cut(word, "=")
				switch v, given := buildArgs[k]; {
				case given:
					vars[k] = v
				case hasDefault:
					vars[k] = unquote(def)
				default:
					vars[k] = globalArgs[k]
				}
			}
			continue // Docker records no history for ARG
		case "LABEL":
			words, err := shellWords(in.args, vars)
			if err != nil {
				return nil, fail("%v", err)
			}
			for _, w := range words {
				k, v, ok := strings.Cut(w, "=")
				if !ok || k == "" {
					return nil, fail("want KEY=VALUE pairs, got %q", w)
				}
				cfg.labels[k] = v
			}
		case "ENV":
			words, err := shellWords(in.args, vars)
			if err != nil {
				return nil, fail("%v", err)
			}
			for _, w := range words {
				k, _, ok := strings.Cut(w, "=")
				if !ok || k == "" {
					return nil, fail("want KEY=VALUE pairs, got %q", w)
				}
				cfg.env = setEnv(cfg.env, w)
				vars[k] = w[len(k)+1:]
			}
		case "USER", "WORKDIR":
			words, err := shellWords(in.args, vars)
			if err != nil || len(words) != 1 {
				return nil, fail("want one word, got %q", in.args)
			}
			if in.keyword == "USER" {
				cfg.user = words[0]
			} else {
				cfg.workdir = path.Join("/", cfg.workdir, words[0])
			}
		case "EXPOSE":
			words, err := shellWords(in.args, vars)
			if err != nil {
				return nil, fail("%v", err)
			}
			for _, w := range words {
				if !strings.Contains(w, "/") {
					w += "/tcp"
				}
				cfg.ports = append(cfg.ports, w)
			}
		case "ENTRYPOINT", "CMD":
			var argv []string
			if err := json.Unmarshal([]byte(in.args), &argv); err != nil {
				// The shell form runs /bin/sh, which an image FROM scratch does not have.
				return nil, fail("only the JSON (exec) form works FROM scratch: %v", err)
			}
			if in.keyword == "ENTRYPOINT" {
				cfg.entrypoint = argv
				cfg.cmd = nil // as Docker: a new ENTRYPOINT resets an inherited CMD
			} else {
				cfg.cmd = argv
			}
		case "COPY":
			words := strings.Fields(in.args)
			if len(words) != 3 || !strings.HasPrefix(words[0], "--from=") {
				return nil, fail("only `COPY --from=STAGE BINARY DEST` (the binary) is supported, got %q", in.args)
			}
			if cfg.binaryDest != "" {
				return nil, fail("a second COPY: only the binary is supported")
			}
			cfg.binaryDest = words[2]
			if strings.HasSuffix(cfg.binaryDest, "/") {
				cfg.binaryDest += path.Base(words[1])
			}
			cfg.copyHistory = len(cfg.history)
		default:
			return nil, fail("not supported in the final stage by this image builder")
		}
		cfg.history = append(cfg.history, v1.History{
			CreatedBy:  in.keyword + " " + strings.Join(strings.Fields(in.args), " "),
			Comment:    "tools/image",
			EmptyLayer: in.keyword != "COPY",
		})
	}
	if cfg.binaryDest == "" {
		return nil, errors.New("the final stage copies no binary")
	}
	if len(cfg.entrypoint) == 0 && len(cfg.cmd) == 0 {
		return nil, errors.New("the final stage has neither ENTRYPOINT nor CMD")
	}
	return cfg, nil
}

type instruction struct {
	keyword string
	args    string
	line    int
}

// logicalLines joins continuation lines and drops comments and blank lines.
func logicalLines(text string) ([]instruction, error) {
	var out []instruction
	var current strings.Builder
	start := 0
	for i, raw := range strings.Split(text, "\n") {
		line := strings.TrimRight(raw, " \t\r")
		trimmed := strings.TrimSpace(line)
		if current.Len() == 0 && (trimmed == "" || strings.HasPrefix(trimmed, "#")) {
			continue
		}
		if current.Len() > 0 && strings.HasPrefix(trimmed, "#") {
			continue // comment lines inside a continuation are skipped, as Docker does
		}
		if current.Len() == 0 {
			start = i + 1
		}
		if strings.HasSuffix(line, "\\") {
			current.WriteString(strings.TrimSuffix(line, "\\"))
			current.WriteString(" ")
			continue
		}
		current.WriteString(line)
		keyword, args, _ := strings.Cut(strings.TrimSpace(current.String()), " ")
		out = append(out, instruction{keyword: strings.ToUpper(keyword), args: strings.TrimSpace(args), line: start})
		current.Reset()
	}
	if current.Len() > 0 {
		return nil, errors.New("the Dockerfile ends inside a continued line")
	}
	return out, nil
}

// shellWords splits like the Dockerfile's word rules: whitespace separates, double quotes group and
// substitute $VAR/${VAR}, single quotes group literally, a backslash escapes the next character.
func shellWords(s string, vars map[string]string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord := false
	quote := rune(0)
	runes := []rune(s)
	for i := 0; i < len(runes); i++ {
		c := runes[i]
		switch {
		case quote == '\'' && c == '\'':
			quote = 0
		case quote == '\'':
			w.WriteRune(c)
		case c == '\\' && i+1 < len(runes):
			i++
			w.WriteRune(runes[i])
			inWord = true
		case c == '$':
			value, next, err := variable(runes, i, vars)
			if err != nil {
				return nil, err
			}
			w.WriteString(value)
			i = next - 1
			inWord = true
		case quote == '"' && c == '"':
			quote = 0
		case quote == '"':
			w.WriteRune(c)
		case c == '"' || c == '\'':
			quote = c
			inWord = true
		case c == ' ' || c == '\t':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		default:
			w.WriteRune(c)
			inWord = true
		}
	}
	if quote != 0 {
		return nil, fmt.Errorf("unterminated quote in %q", s)
	}
	if inWord {
		words = append(words, w.String())
	}
	return words, nil
}

// variable expands $NAME or ${NAME} at runes[i] ('$'); returns the value and the index after it.
func variable(runes []rune, i int, vars map[string]string) (string, int, error) {
	isName := func(c rune) bool {
		return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')
	}
	j := i + 1
	if j < len(runes) && runes[j] == '{' {
		end := j + 1
		for end < len(runes) && isName(runes[end]) {
			end++
		}
		if end >= len(runes) || runes[end] != '}' {
			return "", 0, fmt.Errorf("only ${NAME} is supported, in %q", string(runes))
		}
		return vars[string(runes[j+1:end])], end + 1, nil
	}
	for j < len(runes) && isName(runes[j]) {
		j++
	}
	if j == i+1 {
		return "$", j, nil
	}
	return vars[string(runes[i+1:j])], j, nil
}

func unquote(s string) string {
	if len(s) >= 2 && (s[0] == '"' || s[0] == '\'') && s[len(s)-1] == s[0] {
		return s[1 : len(s)-1]
	}
	return s
}

func setEnv(env []string, kv string) []string {
	k, _, _ := strings.Cut(kv, "=")
	for i, e := range env {
		if strings.HasPrefix(e, k+"=") {
			env[i] = kv
			return env
		}
	}
	return append(env, kv)
}

// elfMachines is the ELF machine of each architecture an image can be built for.
var elfMachines = map[string]elf.Machine{
	"amd64": elf.EM_X86_64,
	"arm64": elf.EM_AARCH64,
}

// checkMachine refuses a binary that is not a Linux ELF executable for the platform's architecture:
// an image whose binary cannot run on the platform it claims fails only where it is pulled (an arm64
// node given an amd64 binary: `exec format error`).
func checkMachine(file string, platform v1.Platform) error {
	want, ok := elfMachines[platform.Architecture]
	if platform.OS != "linux" || !ok {
		return fmt.Errorf("platform %s: only linux/amd64 and linux/arm64 are built", platform)
	}
	f, err := elf.Open(file)
	if err != nil {
		return fmt.Errorf("%s is not an ELF executable: %w", file, err)
	}
	defer f.Close()
	if f.Machine != want {
		return fmt.Errorf("%s is a %s binary, not %s for %s", file, f.Machine, want, platform)
	}
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("%s is not an executable (%s)", file, f.Type)
	}
	return nil
}

// buildImage puts the binary at the COPY destination, root-owned and executable as COPY would, with
// the stage's configuration, in an OCI image for one platform.
func buildImage(cfg *stageConfig, platform v1.Platform, binary string, created time.Time) (v1.Image, error) {
	data, err := os.ReadFile(binary)
	if err != nil {
		return nil, err
	}
	if !bytes.HasPrefix(data, []byte("\x7fELF")) {
		return nil, fmt.Errorf("%s is not an ELF executable", binary)
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{
		Typeflag: tar.TypeReg,
		Name:     strings.TrimPrefix(path.Clean("/"+cfg.binaryDest), "/"),
		Mode:     0o755,
		Size:     int64(len(data)),
		ModTime:  created,
		Format:   tar.FormatPAX,
	}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(data); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	layerBytes := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerBytes)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	base := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	base = mutate.ConfigMediaType(base, types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, err
	}
	file, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	file = file.DeepCopy()
	file.OS = platform.OS
	file.Architecture = platform.Architecture
	file.Variant = platform.Variant
	file.Created = v1.Time{Time: created}
	file.Config = v1.Config{
		Labels:     cfg.labels,
		User:       cfg.user,
		Entrypoint: cfg.entrypoint,
		Cmd:        cfg.cmd,
		Env:        cfg.env,
		WorkingDir: cfg.workdir,
	}
	if len(cfg.ports) > 0 {
		file.Config.ExposedPorts = map[string]struct{}{}
		for _, p := range cfg.ports {
			file.Config.ExposedPorts[p] = struct{}{}
		}
	}
	file.History = nil
	for i, h := range cfg.history {
		h.Created = v1.Time{Time: created}
		if i == cfg.copyHistory {
			h.CreatedBy = fmt.Sprintf("COPY %s %s", path.Base(binary), cfg.binaryDest)
		}
		file.History = append(file.History, h)
	}
	return mutate.ConfigFile(img, file)
}

func writeLayout(dir string, images []platformImage, tag string) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	index := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, pi := range images {
		platform := pi.platform
		index = mutate.AppendManifests(index, mutate.IndexAddendum{
			Add:        pi.image,
			Descriptor: v1.Descriptor{Platform: &platform},
		})
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	var options []layout.Option
	if tag != "" {
		ref, err := name.ParseReference(tag)
		if err != nil {
			return fmt.Errorf("--tag %q: %w", tag, err)
		}
		options = append(options, layout.WithAnnotations(map[string]string{
			"org.opencontainers.image.ref.name": ref.Identifier(),
		}))
	}
	if err := p.AppendIndex(index, options...); err != nil {
		return err
	}
	digest, err := index.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("OCI layout %s: index %s\n", dir, digest)
	for _, pi := range images {
		if err := describe(pi); err != nil {
			return err
		}
	}
	return nil
}

func describe(pi platformImage) error {
	manifest, err := pi.image.Manifest()
	if err != nil {
		return err
	}
	digest, err := pi.image.Digest()
	if err != nil {
		return err
	}
	compressed := manifest.Config.Size
	for _, l := range manifest.Layers {
		compressed += l.Size
	}
	raw, err := pi.image.RawManifest()
	if err != nil {
		return err
	}
	compressed += int64(len(raw))
	info, err := os.Stat(pi.binary)
	if err != nil {
		return err
	}
	fmt.Printf("  %s: manifest %s, %d layer(s), image size %s compressed (binary %s uncompressed)\n",
		pi.platform.String(), digest, len(manifest.Layers), human(compressed), human(info.Size()))
	return nil
}

func writeTarball(file string, images []platformImage, platform, tag string) error {
	ref, err := name.NewTag(tag)
	if err != nil {
		return fmt.Errorf("--tag %q: %w", tag, err)
	}
	chosen := images[0]
	if platform != "" {
		want, err := v1.ParsePlatform(platform)
		if err != nil {
			return err
		}
		found := false
		for _, pi := range images {
			if pi.platform.Equals(*want) {
				chosen, found = pi, true
			}
		}
		if !found {
			return fmt.Errorf("no --binary for --tarball-platform %s", platform)
		}
	}
	if err := tarball.WriteToFile(file, ref, chosen.image); err != nil {
		return err
	}
	info, err := os.Stat(file)
	if err != nil {
		return err
	}
	fmt.Printf("docker load tarball %s: %s, %s (%s)\n", file, ref.String(), chosen.platform.String(), human(info.Size()))
	return nil
}

func human(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB"}
	f := float64(n)
	i := 0
	for f >= 1024 && i < len(units)-1 {
		f /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s (%d bytes)", f, units[i], n)
}
