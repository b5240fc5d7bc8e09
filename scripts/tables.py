"""The CSV and markdown files of the results scripts, each replaced in one step: a run cut short
leaves the last whole file, never half of one."""
import csv
import os


def write_csv(path, rows, fields=None, digits=None):
    """path (.csv) with `rows` (dicts) under the columns `fields` (default: the first row's),
    floats written with `digits` decimals where given."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields or rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow(r if digits is None else
                       {k: (f"{v:.{digits}f}" if isinstance(v, float) else v)
                        for k, v in r.items()})
    os.replace(tmp, path)


def write_tables(out, lines, rows, digits=3):
    """OUT.md (`lines`) and OUT.csv (`rows`, floats with `digits` decimals)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out.with_suffix(".csv"), rows, digits=digits)
    tmp = out.with_name(out.name + ".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out.with_suffix(".md"))
