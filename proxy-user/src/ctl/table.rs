//! Left-aligned text columns, two spaces apart, no trailing blanks: the `table` and `wide`
//! output of every listing.

/// A table under construction.
#[derive(Debug, Default)]
pub struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with a header row.
    pub fn new(header: &[&str]) -> Self {
        Self {
            rows: vec![header.iter().map(|h| (*h).to_string()).collect()],
        }
    }

    /// Appends a row (missing trailing cells are empty).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// Number of rows below the header.
    pub fn len(&self) -> usize {
        self.rows.len() - 1
    }

    /// No rows below the header.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The aligned text, each line prefixed with `indent`.
    pub fn render(&self, indent: &str) -> String {
        let cols = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut widths = vec![0usize; cols];
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::from(indent);
            for (i, cell) in row.iter().enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                line.push_str(cell);
                if i + 1 < row.len() {
                    line.extend(std::iter::repeat_n(' ', widths[i] - cell.chars().count()));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_without_trailing_blanks() {
        let mut t = Table::new(&["A", "LONGER", "C"]);
        t.row(vec!["xyz".into(), "1".into(), String::new()]);
        t.row(vec!["".into(), "22".into(), "last".into()]);
        assert_eq!(
            t.render("  "),
            "  A    LONGER  C\n  xyz  1\n       22      last\n"
        );
    }
}
