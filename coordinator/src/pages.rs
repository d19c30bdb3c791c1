//! `podsim report DIR`: a run's or a study's pages drawn again from what the folder holds.

use std::path::Path;

/// `podsim report DIR`: draws `report.html` again from `DIR/report.json`, and `study.html`
/// from a study's `results.csv` and plots when `DIR` holds a study. Returns the pages written.
pub fn redraw(dir: &Path) -> Result<Vec<std::path::PathBuf>, String> {
    match std::fs::metadata(dir) {
        Err(e) => return Err(format!("{}: {e}", dir.display())),
        Ok(meta) if !meta.is_dir() => {
            return Err(format!(
                "{}: not a folder (podsim report takes a run's or a study's output folder)",
                dir.display()
            ));
        }
        Ok(_) => {}
    }
    let mut pages = Vec::new();
    let report = dir.join("report.json");
    if report.exists() {
        pages.push(crate::report::write_html(
            dir,
            &crate::report::read(&report)?,
        )?);
    }
    if dir.join("results.csv").exists() {
        pages.push(crate::study::write_html(dir)?);
    }
    if pages.is_empty() {
        return Err(format!(
            "{}: holds neither report.json nor results.csv",
            dir.display()
        ));
    }
    Ok(pages)
}
