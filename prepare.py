"""
Prepare a dataset: read text, tokenize it, write flat token files, as in nanoGPT's data/*/prepare.py.

    python prepare.py shakespeare_char                         # characters (65 symbols), nanoGPT's split
    python prepare.py shakespeare                              # GPT-2 BPE via tiktoken
    python prepare.py wikitext103                              # via Hugging Face `datasets` (pip install)
    python prepare.py wikitext103_word                         # the same text, paper 1's word tokenizer
    python prepare.py fineweb_edu --num_docs=100000            # streams FineWeb-Edu sample-10BT
    python prepare.py openwebtext --val_fraction=0.0005        # streams OpenWebText (nanoGPT's GPT-2 data)
    python prepare.py gutenberg --input=path/to/books --tokenizer=gpt2           # any .txt file or folder

Writes data/<dataset>/train.bin and val.bin (flat token ids: uint16, or uint32 when the vocabulary has
65536 or more entries) and meta.json: dataset, tokenizer, vocab_size, dtype, train_tokens, val_tokens, and
itos (id -> character for char, id -> token for word). `get_tokenizer(meta)` turns meta.json back into
encode/decode; train.py calls `prepare(...)` when data/shakespeare_char is missing.
"""
import collections
import difflib
import itertools
import json
import os
import re
import urllib.request

import numpy as np

from configurator import Parser, die, first_line

SHAKESPEARE_URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
TEXT_DATASETS = {'shakespeare_char': 'char', 'shakespeare': 'gpt2'}  # tinyshakespeare, two tokenizers
HF_DATASETS = {'wikitext103': 'gpt2', 'wikitext103_word': 'word',   # via Hugging Face `datasets`, each with
               'fineweb_edu': 'gpt2', 'openwebtext': 'gpt2'}          # its one tokenizer
TOKENIZERS = ('char', 'gpt2', 'word')

# -----------------------------------------------------------------------------
# tokenizers

def gpt2_encoding():
    import tiktoken
    try:
        return tiktoken.get_encoding('gpt2')
    except Exception as e:  # offline with no cache: requests' ConnectionError, many lines long
        die(f"could not load tiktoken's GPT-2 files ({type(e).__name__}); offline, set TIKTOKEN_CACHE_DIR to "
            f"a folder holding them (tiktoken's cache)")

# Paper 1's word-level tokenizer, as its reference code builds it for WikiText-103: every match of
# WORD_PATTERN is a token, whitespace runs included. Characters the pattern does not match (letters and
# digits outside ASCII: \w, but not [A-Za-z0-9_]) belong to no token and are dropped, so decoding loses them.
# The vocabulary is the reference's too: its four special tokens at ids 0-3, then the WORD_VOCAB - 4 tokens
# counted most often (at least WORD_MIN_COUNT times), by count, ties by the token's code points. Every other
# token is one <unk>; only <unk> ever occurs in the data (no padding, no document marks).
WORD_PATTERN = re.compile(r'\s+|[A-Za-z0-9_]+|[^\w\s]')
WORD_SPECIALS = ('<pad>', '<bos>', '<eos>', '<unk>')
WORD_UNK = WORD_SPECIALS.index('<unk>')
WORD_VOCAB = 20_000                    # specials included: the reference's max_vocab_size
WORD_MIN_COUNT = 2

def word_vocab(texts, size=WORD_VOCAB, min_count=WORD_MIN_COUNT):
    """texts (each counted on its own) -> itos: the specials, then the most frequent tokens."""
    counts = collections.Counter()
    for text in texts:
        counts.update(WORD_PATTERN.findall(text))
    # a match is one punctuation character or a run of one class, so no token can spell a special
    kept = sorted((t for t, c in counts.items() if c >= min_count), key=lambda t: (-counts[t], t))
    return [*WORD_SPECIALS, *kept[:size - len(WORD_SPECIALS)]]

def word_encoder(itos):
    stoi = {t: i for i, t in enumerate(itos)}
    return lambda s: [stoi.get(t, WORD_UNK) for t in WORD_PATTERN.findall(s)]

def get_tokenizer(meta):
    """meta.json dict -> (encode: str -> list[int], decode: list[int] -> str)"""
    if meta['tokenizer'] == 'char':
        itos = meta['itos']
        stoi = {ch: i for i, ch in enumerate(itos)}
        def encode(s):
            unknown = sorted(set(s) - stoi.keys())
            if unknown:
                raise ValueError(f"{len(unknown)} character(s) not in the {meta['dataset']} vocabulary: "
                                 f"{''.join(unknown[:10])!r}")
            return [stoi[c] for c in s]
        # ids past the vocabulary (a model trained with a larger vocab_size than the data's) have no text
        return encode, lambda ids: ''.join(itos[i] for i in ids if i < len(itos))
    if meta['tokenizer'] == 'gpt2':
        enc = gpt2_encoding()
        encode = lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})
        # a model may pad its vocabulary past 50257 (nanoGPT uses 50304 for speed); those ids have no text
        decode = lambda ids: enc.decode([i for i in ids if i < enc.n_vocab])
        return encode, decode
    if meta['tokenizer'] == 'word':
        itos = meta['itos']
        # an unknown token encodes as <unk>, which decodes as the text '<unk>'; dropped characters stay lost
        return word_encoder(itos), lambda ids: ''.join(itos[i] for i in ids if i < len(itos))
    raise ValueError(f"tokenizer={meta['tokenizer']!r}: choose one of {', '.join(TOKENIZERS)}")

def token_dtype(vocab_size):
    # uint16 holds ids 0..65535; a bigger vocabulary needs 4 bytes per token
    return 'uint16' if vocab_size < 2**16 else 'uint32'

# -----------------------------------------------------------------------------
# reading text

def read_text(path):
    """A .txt file, or a folder of them (sorted by name, joined). CRLF -> LF: '\\r\\n' would cost a token."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith('.txt'))
        if not files:
            die(f"--input={path}: folder has no .txt files")
        parts = [read_text(os.path.join(path, f)) for f in files]
        return ''.join(p if p.endswith('\n') else p + '\n' for p in parts)
    if not os.path.isfile(path):
        die(f"--input={path}: no such file or folder")
    try:
        with open(path, encoding='utf-8') as f:
            return f.read().replace('\r\n', '\n')
    except UnicodeDecodeError as e:
        die(f"--input={path}: not UTF-8 text ({e.reason} at byte {e.start})")

def download(url, path):
    """url -> path, read in 64 KiB chunks with a progress bar (bytes, of the size the server announces)."""
    from tqdm import tqdm
    with urllib.request.urlopen(url, timeout=30) as r, open(path, 'wb') as f:
        total = int(r.headers.get('Content-Length') or 0) or None
        with tqdm(total=total, unit='B', unit_scale=True, desc=os.path.basename(url)) as bar:
            while chunk := r.read(1 << 16):
                f.write(chunk)
                bar.update(len(chunk))

def shakespeare_path(out_dir, dataset):
    """out_dir/<dataset>/input.txt, downloaded once from SHAKESPEARE_URL (as nanoGPT does)."""
    path = os.path.join(out_dir, dataset, 'input.txt')
    if not os.path.isfile(path):
        print(f"downloading {SHAKESPEARE_URL}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            download(SHAKESPEARE_URL, path + '.tmp')  # under its real name only once complete
        except (OSError, ValueError) as e:
            die(f"could not download tinyshakespeare from {SHAKESPEARE_URL} ({first_line(e)}); offline, "
                f"prepare a local copy with: python prepare.py {dataset} --input=PATH/input.txt")
        os.replace(path + '.tmp', path)
    return path

# -----------------------------------------------------------------------------
# tokenizing a long text piece by piece, with a progress bar

# a newline between two non-space characters. GPT-2's pre-tokenizer always splits on both sides of it, so
# encoding the text cut there, piece by piece, gives exactly the ids of encoding it whole. Cutting after
# any newline would not: a run of newlines ('\n\n' is one token) or spaces before one would split differently.
SAFE_CUT = re.compile(r'(?<=\S\n)(?=\S)')

def pieces(text, size):
    """text in consecutive pieces of at least `size` characters (the last may be shorter), cut at SAFE_CUT."""
    start = 0
    while start < len(text):
        cut = SAFE_CUT.search(text, start + size)
        end = cut.start() if cut else len(text)
        yield text[start:end]
        start = end

def encode_pieces(encode, text, desc, size=1 << 22):
    """encode(text) as consecutive id lists, one per piece; a progress bar for texts longer than a piece."""
    from tqdm import tqdm
    with tqdm(total=len(text), desc=desc, unit='char', unit_scale=True, disable=len(text) <= size) as bar:
        for piece in pieces(text, size):
            yield encode(piece)
            bar.update(len(piece))

# -----------------------------------------------------------------------------
# writing token files

class TokenWriter:
    """Appends token ids to a .bin file; the file appears under its real name only when closed complete."""
    def __init__(self, path, dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self.f = open(path + '.tmp', 'wb')

    def write(self, ids):
        arr = np.asarray(ids, dtype=np.int64)
        assert arr.size == 0 or 0 <= arr.min() <= arr.max() <= np.iinfo(self.dtype).max, 'id out of range'
        self.f.write(arr.astype(self.dtype).tobytes())
        self.count += arr.size

    def close(self):
        self.f.close()
        os.replace(self.path + '.tmp', self.path)
        return self.count

# Paper 1's training protocol (its reference code): windows of WINDOW + 1 tokens (WINDOW inputs, each with
# the next token as its target) starting every STRIDE tokens, so each epoch passes over every token about
# WINDOW / STRIDE = 2 times; shuffled, EPOCHS epochs, an epoch's last batch partial. train.py instead draws
# random windows: the same number of steps sees the same number of tokens, not in the same order.
WINDOW, STRIDE, EPOCHS = 256, 128, 4
PAPER_BATCH = {'44m': 64, '129m': 32}  # sequences per step at each model size
# Before WikiText-103 is prepared, its word-token count is estimated: the published train size is
# 103,227,021 tokens (Merity et al. 2016), and in the raw text each of them is followed by whitespace, so the
# pattern gives about 2 tokens per published token (2.0015 per whitespace-separated word on the offline
# Gutenberg books with punctuation spaced apart as WikiText writes it; 2.25 as the books are written).
WIKITEXT103_WORDS = 103_227_021
WIKITEXT103_WORD_TOKENS = 2 * WIKITEXT103_WORDS  # an estimate; prepare.py prints the exact count

def protocol_windows(n_tokens, window=WINDOW, stride=STRIDE):
    """Windows per epoch: starts 0, stride, ... while a whole window fits (at least one, as the reference)."""
    return len(range(0, max(1, n_tokens - window), stride))

def protocol_steps(n_tokens, batch_size, epochs=EPOCHS):
    """Optimizer steps of the protocol: epochs x batches per epoch (the last one partial)."""
    return epochs * -(-protocol_windows(n_tokens) // batch_size)

def print_protocol(n_tokens):
    n = protocol_windows(n_tokens)
    steps = ', '.join(f"max_iters={protocol_steps(n_tokens, b)} at batch {b} ({size})"
                      for size, b in PAPER_BATCH.items())
    print(f"paper 1's protocol: {n:,} windows of {WINDOW} tokens at stride {STRIDE} per epoch; "
          f"{EPOCHS} epochs: {steps}")

def count_id(path, dtype, token):
    data = np.memmap(path, dtype=dtype, mode='r') if os.path.getsize(path) else np.zeros(0, dtype)
    return sum(int((data[i:i + (1 << 24)] == token).sum()) for i in range(0, len(data), 1 << 24))

def write_meta(dataset, out_dir, meta):
    """meta.json is written last: its presence says the .bin files beside it are complete."""
    folder = os.path.join(out_dir, dataset)
    for split in ('train', 'val'):
        n = meta[f'{split}_tokens']
        if n == 0:
            die(f"{dataset}: the {split} split is empty; give more text or change --val_fraction")
        mib = n * np.dtype(meta['dtype']).itemsize / 2**20
        print(f"{split}.bin: {n:,} tokens ({meta['dtype']}, {mib:.1f} MiB)")
        if meta['tokenizer'] == 'word':
            unk = count_id(os.path.join(folder, f'{split}.bin'), meta['dtype'], WORD_UNK)
            print(f"  of which {unk:,} <unk> ({unk / n:.2%}): tokens outside the vocabulary, one <unk> each")
    with open(os.path.join(folder, 'meta.json.tmp'), 'w', encoding='utf-8') as f:
        json.dump(meta, f, ensure_ascii=False)
    os.replace(os.path.join(folder, 'meta.json.tmp'), os.path.join(folder, 'meta.json'))
    print(f"wrote {folder}: vocab_size {meta['vocab_size']:,}, tokenizer {meta['tokenizer']}")
    if meta['tokenizer'] == 'word':
        print_protocol(meta['train_tokens'])
    return meta

def start_folder(out_dir, dataset):
    # a meta.json left from an earlier run must not vouch for the .bin files about to be rewritten
    folder = os.path.join(out_dir, dataset)
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(os.path.join(folder, 'meta.json')):
        os.remove(os.path.join(folder, 'meta.json'))
    return folder

def write_dataset(dataset, out_dir, tokenizer, vocab_size, splits, itos=None):
    """splits: {'train': iterable of id lists, 'val': ...} -> the .bin files and meta.json; returns meta"""
    start_folder(out_dir, dataset)
    meta = dict(dataset=dataset, tokenizer=tokenizer, vocab_size=vocab_size, dtype=token_dtype(vocab_size))
    for split, chunks in splits.items():
        w = TokenWriter(os.path.join(out_dir, dataset, f'{split}.bin'), meta['dtype'])
        for ids in chunks:
            w.write(ids)
        meta[f'{split}_tokens'] = w.close()
    if itos is not None:
        meta['itos'] = itos
    return write_meta(dataset, out_dir, meta)

def prepare_text(dataset, text, tokenizer, out_dir, val_fraction):
    """One text, split by characters as nanoGPT does: the first 1 - val_fraction trains, the rest is val."""
    if not text:
        die(f"{dataset}: the input text is empty")
    n = len(text)
    train_text, val_text = text[:int(n * (1 - val_fraction))], text[int(n * (1 - val_fraction)):]
    print(f"{dataset}: {n:,} characters, {len(train_text):,} train / {len(val_text):,} val")
    if not train_text or not val_text:
        die(f"{dataset}: {n} characters leave the {'val' if train_text else 'train'} split empty; "
            f"give more text or change --val_fraction")
    itos = None
    if tokenizer == 'char':
        itos = sorted(set(text))                  # the vocabulary is every character that occurs
        stoi = {ch: i for i, ch in enumerate(itos)}
        encode, vocab_size = (lambda s: [stoi[c] for c in s]), len(itos)
    elif tokenizer == 'word':
        # counted over the whole text, as for char (and as the reference counts WikiText-103's train + val);
        # counting piece by piece is exact: a SAFE_CUT follows a newline, where a word token ends anyway
        itos = word_vocab(pieces(text, 1 << 22))
        encode, vocab_size = word_encoder(itos), len(itos)
    else:
        enc = gpt2_encoding()
        encode, vocab_size = enc.encode_ordinary, enc.n_vocab
    splits = {'train': encode_pieces(encode, train_text, f'{dataset} train'),
              'val': encode_pieces(encode, val_text, f'{dataset} val')}
    return write_dataset(dataset, out_dir, tokenizer, vocab_size, splits, itos=itos)

# -----------------------------------------------------------------------------
# reading what this file wrote: train.py, sample.py and eval_depth.py check the data here, once

def prepare_command(data_dir):
    """The command that writes data_dir: a known dataset's own, else one for your text (--input)."""
    root, dataset = os.path.split(os.path.normpath(data_dir))
    where = '' if root == 'data' else f" --out_dir {root or '.'}"
    if dataset in (*TEXT_DATASETS, *HF_DATASETS):
        return f"python prepare.py {dataset}{where}"
    return f"python prepare.py {dataset} --input=PATH{where}"  # any other name is a folder for your text

def missing_file(path, data_dir):
    """Die: path, a file of data_dir, is not there. A name near a known dataset's is taken for a typo of it
    (shakespeare_chr): the message names that dataset and its command first."""
    root, dataset = os.path.split(os.path.normpath(data_dir))
    near = difflib.get_close_matches(dataset, [*TEXT_DATASETS, *HF_DATASETS], n=1)
    if near and near[0] != dataset:
        die(f"{path} not found: {dataset!r} is not a dataset prepare.py knows; did you mean {near[0]}? "
            f"(prepare it with `{prepare_command(os.path.join(root, near[0]))}`; for your own text: "
            f"`{prepare_command(data_dir)}`)")
    die(f"{path} not found: prepare the data first with `{prepare_command(data_dir)}`")

def load_meta(data_dir):
    """data_dir/meta.json as a dict, checked; a missing or broken file dies with the prepare command."""
    path = os.path.join(data_dir, 'meta.json')
    if not os.path.isfile(path):
        missing_file(path, data_dir)
    try:
        with open(path, encoding='utf-8') as f:
            meta = json.load(f)
        vocab_size, dtype = meta['vocab_size'], meta['dtype']
    except (OSError, ValueError, KeyError, TypeError) as e:
        die(f"{path} is not a prepare.py meta.json ({first_line(e)}); rerun `{prepare_command(data_dir)}`")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1 \
            or dtype not in ('uint16', 'uint32') or vocab_size > np.iinfo(dtype).max + 1:
        die(f"{path}: vocab_size={vocab_size!r} with dtype={dtype!r} is not valid; "
            f"rerun `{prepare_command(data_dir)}`")
    return meta

def check_split(data_dir, split, meta):
    """The number of tokens in data_dir/<split>.bin, after checking the file fits meta.json."""
    path = os.path.join(data_dir, f'{split}.bin')
    dtype = np.dtype(meta['dtype'])
    if not os.path.isfile(path):
        missing_file(path, data_dir)
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        die(f"{path}: {size} bytes is not a whole number of {meta['dtype']} tokens (truncated?); "
            f"rerun `{prepare_command(data_dir)}`")
    # a token id >= vocab_size would index past the embedding table: a device-side assert on CUDA, a
    # cryptic IndexError on the CPU, hours into a run. Scan the whole file once, in 16M-token chunks.
    data = np.memmap(path, dtype=dtype, mode='r') if size else np.zeros(0, dtype)
    for i in range(0, len(data), 1 << 24):
        hi = int(data[i:i + (1 << 24)].max())
        if hi >= meta['vocab_size']:
            die(f"{path} holds token id {hi} >= vocab_size {meta['vocab_size']} from meta.json; "
                f"the files do not belong together, rerun `{prepare_command(data_dir)}`")
    return len(data)

def checkpoint_meta(meta_path, ckpt, ckpt_path):
    """The meta.json to decode a checkpoint's tokens with (sample.py, lab/harness.py): --meta, else
    data/<dataset>/meta.json, else the copy train.py keeps in the checkpoint. A meta.json must agree with the
    checkpoint: other tokens would decode to nonsense."""
    dataset, saved = ckpt.get('dataset', '?'), ckpt.get('meta') or {}
    path = meta_path or os.path.join('data', dataset)
    if not meta_path and not os.path.isfile(os.path.join(path, 'meta.json')) and 'tokenizer' in saved:
        return {'dataset': dataset, **saved}
    if os.path.isfile(path) and os.path.basename(path) != 'meta.json':
        die(f"--meta={path}: give a meta.json written by prepare.py, or the folder holding it")
    meta = load_meta(os.path.dirname(path) if os.path.basename(path) == 'meta.json' else path)  # checks it
    differ = [k for k in ('tokenizer', 'vocab_size', 'itos') if k in saved and saved[k] != meta.get(k)]
    model_vocab = ckpt['model_args'].get('vocab_size')
    if differ or not isinstance(model_vocab, int) or meta['vocab_size'] > model_vocab:
        die(f"{path} disagrees with {ckpt_path} ({', '.join(differ) or 'vocab_size'}: meta.json has "
            f"vocab_size {meta['vocab_size']}, the model {model_vocab}; it was trained on {dataset}); "
            f"pass that dataset's meta.json with --meta")
    return meta


def open_data(data_dir, block_size):
    """meta.json and both splits' token counts, checked; dies with one line if anything does not fit."""
    meta = load_meta(data_dir)
    for split in ('train', 'val'):
        n = check_split(data_dir, split, meta)
        if n < block_size + 1:
            die(f"block_size={block_size} is longer than the {split} split of {data_dir} ({n} tokens); "
                f"use a smaller --block_size or more data")
    return meta

# -----------------------------------------------------------------------------
# Hugging Face datasets: WikiText-103 (paper 1; GPT-2 BPE or its word tokenizer), FineWeb-Edu (paper 2)

def load_hf():
    try:
        import datasets
    except ImportError:
        die(f"{', '.join(HF_DATASETS)} need the Hugging Face datasets package: pip install datasets")
    return datasets

def hf_load(datasets, *args, **kwargs):
    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as e:  # network, hub or cache trouble: keep it to one line
        die(f"datasets.load_dataset{args}: {first_line(e)}")

def batched(rows, n):
    batch = []
    for row in rows:
        batch.append(row)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch

def prepare_wikitext103(out_dir):
    from tqdm import tqdm
    datasets = load_hf()
    enc = gpt2_encoding()
    def chunks(split):
        ds = hf_load(datasets, 'Salesforce/wikitext', 'wikitext-103-raw-v1', split=split)
        # rows are lines of one long text (articles are not marked), so join rows rather than add EOT tokens;
        # encoding 1024 lines at a time keeps memory flat and changes at most a token at a chunk edge
        for rows in batched(tqdm(ds, total=len(ds), desc=f'wikitext103 {split}', unit='line'), 1024):
            yield enc.encode_ordinary(''.join(row['text'] for row in rows))
    return write_dataset('wikitext103', out_dir, 'gpt2', enc.n_vocab,
                         {'train': chunks('train'), 'val': chunks('validation')})

def wikitext_rows(ds, desc):
    """The non-empty rows (lines) of a WikiText split: the reference drops the empty ones."""
    from tqdm import tqdm
    return (row['text'] for row in tqdm(ds, total=len(ds), desc=desc, unit='line') if row['text'])

def encode_joined(encode, rows, sep='\n\n', n=1024):
    """encode(sep.join(rows)) as consecutive id lists, n rows at a time, memory flat. Each piece ends at its
    last whitespace character before a non-space one (str.isspace is the \\s of a str pattern): no word token
    spans that place, so the ids are exactly those of the joined text. The rest waits for the next piece."""
    rest = ''
    for i, batch in enumerate(batched(rows, n)):
        text = rest + (sep if i else '') + sep.join(batch)
        cut = next((j for j in range(len(text) - 1, 0, -1)
                    if text[j - 1].isspace() and not text[j].isspace()), 0)
        rest = text[cut:]
        yield encode(text[:cut])
    yield encode(rest)

def prepare_wikitext103_word(out_dir):
    # paper 1's data as its reference code reads it: the non-empty rows of each split joined with a blank
    # line ('\n\n'), the vocabulary counted row by row over train and validation (each row on its own, so
    # the whitespace run where two rows meet, ' \n\n\n ', is never counted and becomes <unk>), no other marks
    datasets = load_hf()
    ds = {s: hf_load(datasets, 'Salesforce/wikitext', 'wikitext-103-raw-v1', split=s)
          for s in ('train', 'validation')}
    itos = word_vocab(itertools.chain(*(wikitext_rows(d, f'counting {s}') for s, d in ds.items())))
    encode = word_encoder(itos)
    splits = {'train': encode_joined(encode, wikitext_rows(ds['train'], 'wikitext103_word train')),
              'val': encode_joined(encode, wikitext_rows(ds['validation'], 'wikitext103_word val'))}
    return write_dataset('wikitext103_word', out_dir, 'word', len(itos), splits, itos=itos)

# streamed corpora of documents: (Hugging Face path, config name); EOT ends each document
STREAMED = {'fineweb_edu': ('HuggingFaceFW/fineweb-edu', 'sample-10BT'),   # paper 2's data
            'openwebtext': ('Skylion007/openwebtext', None)}               # nanoGPT's GPT-2 reproduction data

def prepare_streamed(dataset, out_dir, val_fraction, num_docs):
    from tqdm import tqdm
    datasets = load_hf()
    enc = gpt2_encoding()
    path, name = STREAMED[dataset]
    ds = hf_load(datasets, path, name=name, split='train', streaming=True)
    # one pass over the stream feeds both files: document i goes to val when floor((i+1)*f) > floor(i*f),
    # which sends exactly a fraction f of the documents to val, spread evenly, without knowing the total
    folder = start_folder(out_dir, dataset)
    dtype = token_dtype(enc.n_vocab)
    writers = {s: TokenWriter(os.path.join(folder, f'{s}.bin'), dtype) for s in ('train', 'val')}
    for i, doc in enumerate(tqdm(itertools.islice(ds, num_docs), total=num_docs, desc=dataset, unit='doc')):
        split = 'val' if int((i + 1) * val_fraction) > int(i * val_fraction) else 'train'
        writers[split].write(enc.encode_ordinary(doc['text']) + [enc.eot_token])
    meta = dict(dataset=dataset, tokenizer='gpt2', vocab_size=enc.n_vocab, dtype=dtype)
    meta.update({f'{s}_tokens': w.close() for s, w in writers.items()})
    return write_meta(dataset, out_dir, meta)

# -----------------------------------------------------------------------------

def prepare(dataset, input_path=None, tokenizer=None, out_dir='data', val_fraction=0.1, num_docs=None):
    """Write out_dir/<dataset>/{train,val}.bin and meta.json; returns the meta dict."""
    if not (0 < val_fraction < 1):
        die(f"--val_fraction={val_fraction}: must be between 0 and 1")
    if num_docs is not None and num_docs < 1:
        die(f"--num_docs={num_docs}: must be >= 1")
    if tokenizer is not None and tokenizer not in TOKENIZERS:
        die(f"--tokenizer={tokenizer}: choose one of {', '.join(TOKENIZERS)}")
    if not dataset or os.path.basename(dataset) != dataset or dataset in ('.', '..'):
        die(f"dataset {dataset!r}: give a plain folder name like shakespeare_char")
    if input_path is not None:  # your own text: the name is only the folder under out_dir
        return prepare_text(dataset, read_text(input_path), tokenizer or TEXT_DATASETS.get(dataset, 'gpt2'),
                            out_dir, val_fraction)
    if dataset in TEXT_DATASETS:
        text = read_text(shakespeare_path(out_dir, dataset))
        return prepare_text(dataset, text, tokenizer or TEXT_DATASETS[dataset], out_dir, val_fraction)
    if dataset in HF_DATASETS:
        if tokenizer not in (None, HF_DATASETS[dataset]):
            die(f"--tokenizer={tokenizer}: {dataset} is prepared with {HF_DATASETS[dataset]} only")
        if dataset == 'wikitext103':
            return prepare_wikitext103(out_dir)  # it has its own validation split
        if dataset == 'wikitext103_word':
            return prepare_wikitext103_word(out_dir)
        return prepare_streamed(dataset, out_dir, val_fraction, num_docs)
    die(f"unknown dataset {dataset!r}: choose one of {', '.join([*TEXT_DATASETS, *HF_DATASETS])}, "
        f"or give --input=PATH (a .txt file or folder) for your own text")

def main(argv=None):
    p = Parser('prepare.py', __doc__)
    p.add_argument('dataset', help=f"{', '.join([*TEXT_DATASETS, *HF_DATASETS])}, or a name for --input text")
    p.add_argument('--input', default=None, help='a UTF-8 .txt file, or a folder of them')
    p.add_argument('--tokenizer', default=None,
                   help="char, gpt2 or word (paper 1's; default: the dataset's, else gpt2)")
    p.add_argument('--out_dir', default='data', help='writes OUT_DIR/DATASET/{train,val}.bin and meta.json')
    p.add_argument('--val_fraction', type=float, default=0.1, help='share of the text (or documents) for val')
    p.add_argument('--num_docs', type=int, default=None, help='streamed corpora: stop after this many docs')
    args = p.parse_args(argv)
    prepare(args.dataset, args.input, args.tokenizer, args.out_dir, args.val_fraction, args.num_docs)

if __name__ == '__main__':
    main()
